// ProcessGroupUCX::monitoredBarrier (its Impl's): a barrier that tells rank 0 which ranks did not
// arrive, with Gloo's semantics and wording (torch users grep "failed to pass monitoredBarrier").
//
//   * every rank but 0 sends rank 0 an arrival message and waits for rank 0's answer;
//   * rank 0 waits for every arrival until one deadline (opts.timeout, else the group's): without
//     wait_all_ranks it raises naming the first rank that did not arrive, with wait_all_ranks it
//     waits for all and names every missing rank;
//   * rank 0 then answers every rank that arrived: "pass" when all did, "fail" otherwise, so that
//     the ranks that arrived raise promptly as well instead of waiting for their deadline.
//
// Runs on the calling thread (it blocks, like Gloo's). Its messages travel on two internal tags
// drawn from the group's collective sequence (next_tag_): every rank must call it in the same
// order relative to the group's collectives, as for any collective; it cannot match user traffic.
// Every wait has a deadline; whatever is still posted when it returns (a message to or from a rank
// that never came) is cancelled and kept alive by the backend until UCX is done with it.
#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "commux/error.hpp"
#include "commux/process_group_ucx.hpp"
#include "../core/channel.hpp"
#include "errors.hpp"
#include "process_group_ucx_internal.hpp"
#include "work.hpp"

namespace {
constexpr std::uint64_t kMonitoredBarrierFingerprint = 0x6d6f6e6261727269ull;  // "monbarri"
}  // namespace

namespace commux {

using c10d_detail::Clock;
using c10d_detail::P2PWork;

namespace {

constexpr std::int32_t kPass = 1;
constexpr std::int32_t kFail = 2;

std::string join(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

// The failed wait being handled, for the "Original exception" part of a message. Its request is
// cancelled before the error is raised, so a timeout does not say that it is still posted.
std::string quote_current() {
  try {
    throw;
  } catch (const Error& e) {
    return e.with_still_posted(false).what();
  } catch (...) {
    return c10d_detail::current_message();
  }
}

}  // namespace

void ProcessGroupUCX::Impl::monitoredBarrier(const c10d::BarrierOptions& opts,
                                             bool wait_all_ranks) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const int size = getSize();
  const int me = getRank();
  std::uint32_t tag = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) c10d_detail::invalid("monitoredBarrier", "the process group has been shut down");
    tag = next_tag_;
    next_tag_ += 2;  // tag: arrivals (to rank 0); tag + 1: rank 0's answers
  }
  if (size == 1) return;
  const auto limit = effective(opts.timeout);
  const std::string suffix = " (commux monitoredBarrier, " + where() + ")";
  auto& chan = commux::detail::channel(*comm_);

  // One int32 per message, each in its own tensor: a request that is still posted at the end is
  // handed to the backend together with its tensor.
  struct Posted {
    Request request;
    at::Tensor buf;
    int peer;
    bool is_send;
  };
  std::vector<Posted> posted;
  posted.reserve(2 * static_cast<std::size_t>(size));  // references into it stay valid
  auto post = [&](bool is_send, int peer, std::uint32_t t, std::int32_t value) -> Posted& {
    at::Tensor buf = at::full({1}, value, at::TensorOptions().dtype(at::kInt));
    const Buffer b{buf.data_ptr(), sizeof(std::int32_t), MemoryType::kHost};
    // The call's wire tag with a fingerprint of its own: never a collective's (collectives.hpp).
    const std::uint32_t wire = coll::call_wire_tag(t, kMonitoredBarrierFingerprint);
    Request r = is_send ? chan.post_send(&b, 1, peer, TagKind::kInternal, wire, true)
                        : chan.post_recv(&b, 1, peer, TagKind::kInternal, wire);
    posted.push_back(Posted{std::move(r), buf, peer, is_send});
    return posted.back();
  };
  // Nothing stays posted into memory nobody keeps: the unfinished requests are cancelled and the
  // backend keeps their tensors until UCX is done with them.
  auto release = [&]() noexcept {
    for (auto& p : posted) {
      if (!p.request.valid() || p.request.done()) continue;
      try {
        p.request.cancel();
        auto w =
            c10::make_intrusive<P2PWork>(me, p.is_send ? c10d::OpType::SEND : c10d::OpType::RECV,
                                         p.request, std::vector<at::Tensor>{p.buf}, timeout_);
        keep_until_done(w);
      } catch (...) {
      }
    }
  };

  try {
    if (me != 0) {
      // Waits for rank 0 without the monitored timeout (as Gloo): rank 0 reports who is missing,
      // and answers this rank within that timeout; the group's timeout bounds a rank 0 that never
      // comes.
      const auto deadline = Clock::now() + std::max(limit, timeout_);
      Posted& answer = post(false, 0, tag + 1, 0);
      post(true, 0, tag, me);
      std::int32_t verdict = 0;
      try {
        for (auto& p : posted) p.request.wait(left_until(deadline));
        verdict = answer.buf.data_ptr<std::int32_t>()[0];
      } catch (...) {
        c10d_detail::throw_backend_error(
            "Rank " + std::to_string(me) +
            " successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0. Please check rank 0 logs for faulty rank." +
            suffix + "\n Original exception: \n" + quote_current());
      }
      if (verdict != kPass) {
        c10d_detail::throw_backend_error(
            "Rank " + std::to_string(me) +
            " successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0: rank 0 reports that other ranks did not pass it within " +
            std::to_string(limit.count()) + " ms. Please check rank 0 logs for faulty rank." +
            suffix);
      }
      release();
      return;
    }

    // Rank 0: one deadline for every arrival.
    const auto deadline = Clock::now() + limit;
    for (int p = 1; p < size; ++p) post(false, p, tag, 0);
    std::vector<int> arrived, missing;
    std::string first_error;
    for (int p = 1; p < size; ++p) {
      Posted& r = posted[static_cast<std::size_t>(p - 1)];
      try {
        r.request.wait(left_until(deadline));
        arrived.push_back(p);
      } catch (...) {
        missing.push_back(p);
        if (first_error.empty()) first_error = quote_current();
        if (!wait_all_ranks) break;
      }
    }
    // Without wait_all_ranks the ranks after the first missing one were not waited for: those
    // whose arrival is already here are answered too.
    for (std::size_t i = arrived.size() + missing.size(); i + 1 < static_cast<std::size_t>(size);
         ++i) {
      Request& r = posted[i].request;
      if ((r.done() || r.test()) && !r.error()) arrived.push_back(posted[i].peer);
    }
    // The ranks that arrived learn the outcome now; a rank that arrives later than that is told
    // nothing and fails at its own deadline.
    const std::int32_t verdict = missing.empty() ? kPass : kFail;
    const std::size_t first_answer = posted.size();
    for (int p : arrived) post(true, p, tag + 1, verdict);
    std::vector<int> unanswered;
    const auto answer_deadline = Clock::now() + limit;
    for (std::size_t i = first_answer; i < posted.size(); ++i) {
      try {
        posted[i].request.wait(left_until(answer_deadline));
      } catch (...) {
        unanswered.push_back(posted[i].peer);
        if (first_error.empty()) first_error = quote_current();
      }
    }
    if (!missing.empty()) {
      std::string msg;
      if (wait_all_ranks) {
        msg = "[Rank 0]: Ranks " + join(missing) + " failed to pass monitoredBarrier in " +
              std::to_string(limit.count()) + " ms" + suffix;
      } else {
        msg = "[Rank 0]: Rank " + std::to_string(missing[0]) +
              " failed to pass monitoredBarrier in " + std::to_string(limit.count()) + " ms" +
              suffix + "\n Original exception: \n" + first_error;
      }
      c10d_detail::throw_backend_error(msg);
    }
    if (!unanswered.empty()) {
      // Every rank arrived but an answer did not go through: those ranks will fail, so rank 0
      // does too (all ranks leave the barrier successfully or none do).
      c10d_detail::throw_backend_error(
          "[Rank 0]: Rank" + std::string(unanswered.size() > 1 ? "s " : " ") + join(unanswered) +
          " failed to pass monitoredBarrier in " + std::to_string(limit.count()) + " ms" + suffix +
          "\n Original exception: \n" + first_error);
    }
    release();
  } catch (...) {
    release();
    throw;
  }
}

}  // namespace commux
