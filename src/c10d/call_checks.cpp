// Cross-rank call checks in the torch adapter (see src/collectives/calls.cpp for the wire side).
//
//   * A collective rejected on this rank before it was enqueued (bad local input: a ValueError
//     here) still takes its tags, so the group's later calls keep pairing with the other ranks',
//     and tells the other ranks (coll::reject): their matching call fails with DistBackendError
//     naming this rank and the reason.
//   * Messages of a call that failed or was rejected here may still arrive (a peer posted its
//     sends before it learnt). They are dropped before each later collective runs, until the
//     call's tags come round again (65536 calls: a call's messages carry the low 16 bits of its
//     tag), so they never pair with a later call and never wait in UCX forever.
//   * A broadcast or scatter root completes without receiving anything, and so may a reduce or
//     gather rank that is not the root, so ranks that disagree on the root (each passing its own
//     rank, or each another's) could all return with no error: different data from a broadcast,
//     no rank holding a reduce's result. Such a disagreement sends one of these ranks a message
//     it never takes (from its parent in another rank's tree, or from another self-made root or
//     leaf). This rank looks for one before later collectives (a root before each of the next
//     three: the calls are rare; a reduce or gather sender once, before the second call after
//     it: one look per call, as a reduce in a loop pays it); finding one, it fails the
//     collective about to run, on every rank, saying which earlier call went wrong.
//   * A rank that finds a disagreement inside a call (a message of another size than it expects:
//     all_to_all_single splits that differ, say) or stops a call tells every other rank with a
//     notice. The ranks still in the call fail at once; one that had finished it (its own part
//     was consistent) finds the notice before a later collective (check_notices: a progress call
//     and a probe of the transport's unexpected messages, at most once per coarse-clock tick)
//     and fails that collective on every rank, naming the earlier call and what the other rank
//     found.
//   * A group that makes no later collective is told at shutdown (untold_notices): each rank
//     that shuts the group down lets its calls still running end, sends the others a last notice
//     (coll::say_shutdown) and looks until it has every peer's, for at most kShutdownPeerWait in
//     all; a peer's notices and stray root messages arrive before its last one. A call a peer
//     never made fails on that notice.
#include <c10/util/Exception.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include "errors.hpp"
#include "process_group_ucx_internal.hpp"

namespace commux {

namespace {

// Calls after which a dead call's entry is dropped (its tag's low 16 bits are reused after 65536).
constexpr std::uint32_t kDeadFor = 60000;
// At most this many dead calls are remembered (the oldest goes first).
constexpr std::size_t kMaxDead = 64;
constexpr std::size_t kMaxRootCalls = 16;

}  // namespace

void ProcessGroupUCX::Impl::reject_call(const char* op, std::uint32_t ntags,
                                        const std::string& reason) noexcept {
  try {
    std::uint32_t tag = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      tag = next_tag_;
      next_tag_ += ntags;
    }
    coll::Context c;
    c.comm = comm_.get();
    c.tag = tag;
    c.op_name = op;
    coll::reject(c, reason);
    note_dead(tag, ntags);
  } catch (...) {
    // the rejection's own error reaches the caller; telling the peers is best effort
  }
}

void ProcessGroupUCX::Impl::note_dead(std::uint32_t tag, std::uint32_t ntags) {
  std::lock_guard<std::mutex> lk(dead_mu_);
  if (dead_.size() >= kMaxDead) dead_.erase(dead_.begin());
  dead_.emplace_back(tag, ntags);
  any_dead_.store(true, std::memory_order_release);
}

void ProcessGroupUCX::Impl::drain_dead(std::uint32_t current) {
  std::lock_guard<std::mutex> lk(dead_mu_);
  coll::Context c;
  c.comm = comm_.get();
  for (auto it = dead_.begin(); it != dead_.end();) {
    if (static_cast<std::uint32_t>(current - it->first) > kDeadFor) {
      it = dead_.erase(it);
      continue;
    }
    for (std::uint32_t i = 0; i < it->second; ++i) {
      c.tag = it->first + i;
      coll::discard_call(c);
    }
    ++it;
  }
  any_dead_.store(!dead_.empty(), std::memory_order_release);
}

void ProcessGroupUCX::Impl::note_root_call(std::uint32_t tag, const char* op, int skip, int looks) {
  std::lock_guard<std::mutex> lk(dead_mu_);
  if (root_calls_.size() >= kMaxRootCalls) root_calls_.erase(root_calls_.begin());
  root_calls_.push_back(RootCall{tag, op, skip, looks});
  any_root_calls_.store(true, std::memory_order_release);
}

std::string ProcessGroupUCX::Impl::root_call_text(const RootCall& r, int sender) {
  const bool sends = std::strcmp(r.op, "reduce") == 0 || std::strcmp(r.op, "gather") == 0;
  return "rank " + std::to_string(sender) + " sent this rank a message for call #" +
         std::to_string(r.tag) + " (" + r.op + " #" + std::to_string(r.tag) +
         " here, which this rank ran as " + (sends ? "a sender to the root" : "the root") +
         ") that this rank never took: the ranks' calls #" + std::to_string(r.tag) +
         " differed (their roots, say), so its results are wrong on some ranks";
}

void ProcessGroupUCX::Impl::check_root_calls(std::uint32_t current, const char* current_op) {
  auto& chan = ::commux::detail::channel(*comm_);
  std::string reason;
  {
    std::lock_guard<std::mutex> lk(dead_mu_);
    for (auto it = root_calls_.begin(); it != root_calls_.end();) {
      if (it->tag == current) {  // not before itself
        ++it;
        continue;
      }
      if (it->skip > 0) {
        --it->skip;
        ++it;
        continue;
      }
      ::commux::detail::Unexpected u{};
      if (chan.probe(TagKind::kInternal, kAnySource, it->tag, 0xFFFF, &u)) {
        chan.discard(TagKind::kInternal, it->tag, 0xFFFF);
        reason = root_call_text(*it, u.sender);
        root_calls_.erase(it);
        break;
      }
      it = --it->looks > 0 ? it + 1 : root_calls_.erase(it);
    }
    any_root_calls_.store(!root_calls_.empty(), std::memory_order_release);
  }
  if (!reason.empty()) refuse_call(current, current_op, reason);
}

void ProcessGroupUCX::Impl::refuse_call(std::uint32_t current, const char* current_op,
                                        const std::string& reason) {
  coll::Context c;
  c.comm = comm_.get();
  c.tag = current;
  c.op_name = current_op;
  coll::reject(c, reason);  // the others' call #current fails at once, with this reason
  throw Error(Errc::kCallMismatch, ErrorSite{current_op, {}, {}, {}, group_name_},
              reason + "; this call (#" + std::to_string(current) + ") did not run (" + where() +
                  ")");
}

bool ProcessGroupUCX::Impl::notice_look_due() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // a few ns: no clock source is read
  const std::int64_t ms = static_cast<std::int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
  if (notice_looked_ms_.load(std::memory_order_relaxed) == ms) return false;
  notice_looked_ms_.store(ms, std::memory_order_relaxed);
  return true;
}

void ProcessGroupUCX::Impl::check_notices(std::uint32_t current, const char* current_op) {
  coll::Context c;
  c.comm = comm_.get();
  std::uint32_t call = 0;
  int sender = -1;
  // (With a progress call: a rank whose calls only send, a reduce leaf in a loop, progresses
  // nothing else, and would not see the notice arrive.)
  if (!coll::find_notice(c, &call, &sender)) return;
  // This call's notice is this call's to read, a later call's that call's (a rank ahead of this
  // one rejected it).
  if (call == current || current - call >= 0x80000000u) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (running_locked(call)) return;  // a call still running beside this one reads it
  }
  c.tag = call;
  if (failed_here(call)) {  // failed here already, and said so: only dropped
    coll::discard_call(c);
    return;
  }
  // A call that finished here: what the other rank found, then the call's leftovers dropped.
  std::string what, found;
  const char kind = coll::take_notice(c, sender, &what, &found);
  note_dead(call, 1);  // what else comes for it is dropped
  refuse_call(current, current_op, notice_text(call, sender, kind, what, found));
}

bool ProcessGroupUCX::Impl::running_locked(std::uint32_t call) const {
  for (const c10d_detail::Task* r : running_) {
    if (call - r->tag < r->ntags) return true;
  }
  return false;
}

bool ProcessGroupUCX::Impl::failed_here(std::uint32_t call) {
  std::lock_guard<std::mutex> lk(dead_mu_);
  for (const auto& d : dead_) {
    if (call - d.first < d.second) return true;
  }
  return false;
}

std::string ProcessGroupUCX::Impl::notice_text(std::uint32_t call, int sender, char kind,
                                               const std::string& what, const std::string& found) {
  const std::string head =
      kind == 'S' ? "rank " + std::to_string(sender) +
                        " shut down the process group without making call #" + std::to_string(call)
                  : "rank " + std::to_string(sender) + " stopped call #" + std::to_string(call) +
                        (what.empty() ? "" : " (" + what + " there)");
  return head + ", which had finished on this rank" + (found.empty() ? "" : ": " + found) +
         "; the ranks' calls #" + std::to_string(call) +
         " disagreed, so its results are wrong on some ranks";
}

std::string ProcessGroupUCX::Impl::untold_notices(
    const std::deque<std::shared_ptr<c10d_detail::Task>>& never_ran, bool wait_peers) noexcept {
  std::string out;
  if (size_ <= 1 || !comm_) return out;
  try {
    std::uint32_t issued = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      issued = next_tag_;
    }
    coll::Context c;
    c.comm = comm_.get();
    c.tag = issued;
    const auto until =
        std::chrono::steady_clock::now() +
        std::min<std::chrono::milliseconds>(kShutdownPeerWait, comm_->options().shutdown_timeout);
    // A call still running here (an async one nobody waited for) may yet find its ranks
    // disagreeing, and tell them: let it end first (it completes, finds that, or reads a peer's
    // notice; at most until `until`), so that this rank's last notice follows its notices.
    // (Sent first, the peers took it as the end of what this rank would say, and missed them.)
    while (wait_peers && std::chrono::steady_clock::now() < until) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (running_.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    // After everything this rank sent: a peer that has this has all of this rank's notices.
    coll::say_shutdown(c);
    const auto tell = [&](const std::string& text) {
      out += (out.empty() ? "" : "\n") + std::string("commux shutdown: ") + text + " (" + where() +
             ")";
    };
    // A rank that finds a disagreement in a call that returned here may send its notice after
    // this rank shut down: look until every peer has shut down too (its notices came before its
    // say_shutdown), for at most kShutdownPeerWait; then a few more times (one progress call may
    // not have moved a notice that has arrived). With no collective made, nothing is owed.
    // (Bounded: each find takes or drops the notice it finds.)
    std::vector<char> said(static_cast<std::size_t>(size_), 0);
    said[rank_] = 1;
    int left = wait_peers && issued != 0 ? size_ - 1 : 0;
    int misses = 0;
    // Senders whose first notice is for a call still running here: that call reads it (or it
    // ends, and the notice is this look's), and the sender's later notices wait behind it. The
    // look goes on from the other senders meanwhile, and comes back to these once they have
    // nothing (it used to stop at such a notice, and so missed the later notices of every
    // sender, a peer's disagreement in a call that had finished here among them).
    std::vector<char> behind(static_cast<std::size_t>(size_), 0);
    bool any_behind = false;
    for (std::size_t n = 0; n < kMaxDead + static_cast<std::size_t>(size_);) {
      std::uint32_t call = 0;
      int sender = -1;
      bool hit = false;
      if (!any_behind) {
        hit = coll::find_notice(c, &call, &sender);
      } else {
        for (int p = 0; p < size_ && !hit; ++p) {
          if (p != rank_ && behind[p] == 0) hit = coll::find_notice(c, &call, &sender, p);
        }
      }
      if (!hit) {
        std::fill(behind.begin(), behind.end(), 0);
        any_behind = false;
        if (left > 0 && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
          continue;
        }
        if (++misses < 3) continue;
        break;
      }
      c.tag = call;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (running_locked(call)) {
          if (sender < 0 || sender >= size_) break;
          behind[sender] = 1;
          any_behind = true;
          continue;
        }
      }
      ++n;
      std::string what, found;
      const char kind = coll::take_notice(c, sender, &what, &found);
      if (kind == 'S' && sender >= 0 && sender < size_ && said[sender] == 0) {
        said[sender] = 1;
        --left;
      }
      // A call this rank never made (the peer's shutdown, or a call of ranks that made more), a
      // call that failed here (and said so), or one that never ran: only dropped.
      bool dropped = call - issued < 0x80000000u || failed_here(call);
      for (const auto& t : never_ran) dropped = dropped || call - t->tag < t->ntags;
      if (dropped) continue;
      note_dead(call, 1);
      tell(notice_text(call, sender, kind, what, found));
    }
    // The root calls still watched (check_root_calls), whatever looks they had left: a message
    // one never took has arrived by now if the notices have.
    std::vector<RootCall> roots;
    {
      std::lock_guard<std::mutex> lk(dead_mu_);
      roots.swap(root_calls_);
      any_root_calls_.store(false, std::memory_order_release);
    }
    auto& chan = ::commux::detail::channel(*comm_);
    for (const auto& r : roots) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (running_locked(r.tag)) continue;
      }
      ::commux::detail::Unexpected u{};
      if (!chan.probe(TagKind::kInternal, kAnySource, r.tag, 0xFFFF, &u)) continue;
      chan.discard(TagKind::kInternal, r.tag, 0xFFFF);
      tell(root_call_text(r, u.sender));
    }
  } catch (...) {
    // the transport failed while looking: nothing more can be learnt from it
  }
  return out;
}

}  // namespace commux
