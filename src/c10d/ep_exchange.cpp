// ProcessGroupUCX::exchange_bytes: the sparse all-to-all under commux.ep (expert-parallel dispatch
// and combine). Everything happens on the calling thread: no worker-thread hand-off, one message
// per peer that has bytes to receive, self's part copied locally.
//
// Tags: each call takes one internal tag from the group's collective sequence (next_tag_), the
// same counter collectives draw from, so an exchange can never match user point-to-point traffic
// (the internal bit), a collective's messages, another exchange (another Buffer's included) or a
// later call's (the sequence number). Every rank of the group must issue the same sequence of
// collectives and exchanges -- the rule collectives already have.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "commux/process_group_ucx.hpp"
#include "device.hpp"
#include "work.hpp"

namespace commux {

using c10d_detail::Clock;
using c10d_detail::memory_type_of;
using c10d_detail::on_device;
using c10d_detail::P2PWork;
using c10d_detail::StreamFence;

namespace {

[[noreturn]] void bad(const std::string& op, const std::string& what) {
  C10_THROW_ERROR(ValueError, "commux " + op + ": " + what);
}

std::int64_t checked_total(const std::string& op, const std::vector<std::int64_t>& bytes,
                           const char* what, int size) {
  if (static_cast<int>(bytes.size()) != size) {
    bad(op, std::string(what) + " has " + std::to_string(bytes.size()) + " entries, the group has " +
                std::to_string(size) + " ranks");
  }
  std::int64_t total = 0;
  for (std::size_t p = 0; p < bytes.size(); ++p) {
    if (bytes[p] < 0) bad(op, std::string(what) + "[" + std::to_string(p) + "] is negative");
    total += bytes[p];
  }
  return total;
}

}  // namespace

at::Tensor ProcessGroupUCX::exchange_bytes(const std::string& op, const at::Tensor& send,
                                           const std::vector<std::int64_t>& send_bytes,
                                           const std::vector<std::int64_t>& recv_bytes,
                                           std::chrono::milliseconds timeout) {
  const int size = getSize();
  const int me = getRank();
  if (!send.defined() || send.scalar_type() != at::kByte || send.dim() != 1 || !send.is_contiguous()) {
    bad(op, "the send buffer must be a contiguous 1-D uint8 tensor");
  }
  const std::int64_t send_total = checked_total(op, send_bytes, "send_bytes", size);
  const std::int64_t recv_total = checked_total(op, recv_bytes, "recv_bytes", size);
  if (send_total != send.numel()) {
    bad(op, "send_bytes add up to " + std::to_string(send_total) + " bytes, the send buffer holds " +
                std::to_string(send.numel()));
  }
  if (send_bytes[me] != recv_bytes[me]) {
    bad(op, "this rank sends itself " + std::to_string(send_bytes[me]) + " bytes but expects " +
                std::to_string(recv_bytes[me]));
  }
  std::uint32_t tag = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) bad(op, "the process group (" + where() + ") has been shut down");
    tag = next_tag_++;
  }
  at::Tensor out = at::empty({recv_total}, send.options());
  const MemoryType send_mem = on_device(send) ? memory_type_of(op.c_str(), send, "tensor") : MemoryType::kHost;
  const auto limit = effective(timeout);
  const auto deadline = Clock::now() + limit;

  std::vector<std::int64_t> send_off(size + 1, 0), recv_off(size + 1, 0);
  for (int p = 0; p < size; ++p) {
    send_off[p + 1] = send_off[p] + send_bytes[p];
    recv_off[p + 1] = recv_off[p] + recv_bytes[p];
  }
  auto* sbase = static_cast<std::uint8_t*>(send.data_ptr());
  auto* rbase = static_cast<std::uint8_t*>(out.data_ptr());
  struct Posted {
    Request request;
    int peer;
    bool is_send;
  };
  std::vector<Posted> posted;
  posted.reserve(2 * static_cast<std::size_t>(size));
  auto fail = [&](std::exception_ptr e) {
    // Nothing may stay posted into (or from) buffers the caller no longer holds: cancel what is
    // left and let the backend keep the tensors alive until UCX is done with each request.
    for (auto& p : posted) {
      if (p.request.done()) continue;
      p.request.cancel();
      auto w = c10::make_intrusive<P2PWork>(me, p.is_send ? c10d::OpType::SEND : c10d::OpType::RECV,
                                            p.request, std::vector<at::Tensor>{send, out}, timeout_);
      std::lock_guard<std::mutex> lk(mu_);
      reap_locked();
      inflight_.push_back(w);
    }
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      const std::string msg = "commux " + op + " (" + where() + "): " + err.what();
      if (err.code() == Errc::kInvalidArgument || err.code() == Errc::kUnsupported) {
        C10_THROW_ERROR(ValueError, msg);
      }
      C10_THROW_ERROR(DistBackendError, msg);
    }
  };
  try {
    // UCX reads the send buffer from now on: the work queued on its stream must be complete.
    if (send_mem != MemoryType::kHost) StreamFence({send}).wait(deadline, op.c_str());
    for (int p = 0; p < size; ++p) {
      if (p == me || recv_bytes[p] == 0) continue;
      Buffer b{rbase + recv_off[p], static_cast<std::size_t>(recv_bytes[p]), send_mem};
      posted.push_back({comm_->post_recv(&b, 1, p, TagKind::kInternal, tag), p, false});
    }
    for (int i = 1; i < size; ++i) {  // start with the next rank, so no peer is everyone's first
      const int p = (me + i) % size;
      if (send_bytes[p] == 0) continue;
      Buffer b{sbase + send_off[p], static_cast<std::size_t>(send_bytes[p]), send_mem};
      posted.push_back({comm_->post_send(&b, 1, p, TagKind::kInternal, tag), p, true});
    }
    if (send_bytes[me] > 0) {
      out.narrow(0, recv_off[me], recv_bytes[me]).copy_(send.narrow(0, send_off[me], send_bytes[me]));
    }
    for (auto& p : posted) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      try {
        p.request.wait(std::max(left, std::chrono::milliseconds(1)));
      } catch (const Error& err) {
        if (err.code() != Errc::kTimeout) throw;
        throw Error(Errc::kTimeout,
                    std::string("timed out after ") + std::to_string(limit.count()) + " ms waiting for the " +
                        (p.is_send ? "send to" : "message from") + " rank " + std::to_string(p.peer) +
                        " (" + std::to_string(p.is_send ? send_bytes[p.peer] : recv_bytes[p.peer]) +
                        " bytes): has every rank of the group made the same call? (cancelled)");
      }
      if (!p.is_send && p.request.bytes() != static_cast<std::size_t>(recv_bytes[p.peer])) {
        throw Error(Errc::kWireMismatch,
                    "rank " + std::to_string(p.peer) + " sent " + std::to_string(p.request.bytes()) +
                        " bytes where its header announced " + std::to_string(recv_bytes[p.peer]));
      }
    }
  } catch (const c10::Error&) {
    fail(std::current_exception());  // (a c10::Error from ATen or the fence passes through)
    throw;
  } catch (...) {
    fail(std::current_exception());
  }
  return out;
}

}  // namespace commux
