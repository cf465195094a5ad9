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

std::vector<std::int64_t> ProcessGroupUCX::exchange_bytes(
    const std::string& op, const at::Tensor& send, const std::vector<std::int64_t>& send_bytes,
    const at::Tensor& recv, const std::vector<std::int64_t>& recv_offsets,
    const std::vector<std::int64_t>& recv_capacity, std::chrono::milliseconds timeout) {
  const int size = getSize();
  const int me = getRank();
  for (const auto* t : {&send, &recv}) {
    if (!t->defined() || t->scalar_type() != at::kByte || t->dim() != 1 || !t->is_contiguous()) {
      bad(op, std::string(t == &send ? "the send" : "the receive") +
                  " buffer must be a contiguous 1-D uint8 tensor");
    }
  }
  const std::int64_t send_total = checked_total(op, send_bytes, "send_bytes", size);
  checked_total(op, recv_capacity, "recv_capacity", size);
  checked_total(op, recv_offsets, "recv_offsets", size);
  if (send_total != send.numel()) {
    bad(op, "send_bytes add up to " + std::to_string(send_total) + " bytes, the send buffer holds " +
                std::to_string(send.numel()));
  }
  for (int p = 0; p < size; ++p) {
    if (recv_offsets[p] + recv_capacity[p] > recv.numel()) {
      bad(op, "the receive slot of rank " + std::to_string(p) + " lies outside the receive buffer");
    }
  }
  if (send_bytes[me] > recv_capacity[me]) {
    bad(op, "this rank sends itself " + std::to_string(send_bytes[me]) + " bytes, more than its " +
                std::to_string(recv_capacity[me]) + "-byte slot");
  }
  std::uint32_t tag = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) bad(op, "the process group (" + where() + ") has been shut down");
    tag = next_tag_++;
  }
  auto mem_of = [&](const at::Tensor& t) {
    return on_device(t) ? memory_type_of(op.c_str(), t, "tensor") : MemoryType::kHost;
  };
  const MemoryType send_mem = mem_of(send), recv_mem = mem_of(recv);
  const auto limit = effective(timeout);
  const auto deadline = Clock::now() + limit;

  std::vector<std::int64_t> send_off(size + 1, 0);
  for (int p = 0; p < size; ++p) send_off[p + 1] = send_off[p] + send_bytes[p];
  std::vector<std::int64_t> received(size, 0);
  received[me] = send_bytes[me];
  auto* sbase = static_cast<std::uint8_t*>(send.data_ptr());
  auto* rbase = static_cast<std::uint8_t*>(recv.data_ptr());
  struct Posted {
    Request request;
    int peer;
    bool is_send;
  };
  std::vector<Posted> posted;
  posted.reserve(2 * static_cast<std::size_t>(size));
  try {
    // UCX reads the send buffer from now on: the work queued on its stream must be complete.
    if (send_mem != MemoryType::kHost || recv_mem != MemoryType::kHost) {
      StreamFence({send, recv}).wait(deadline, op.c_str());
    }
    for (int p = 0; p < size; ++p) {
      if (p == me || recv_capacity[p] == 0) continue;
      Buffer b{rbase + recv_offsets[p], static_cast<std::size_t>(recv_capacity[p]), recv_mem};
      posted.push_back({comm_->post_recv(&b, 1, p, TagKind::kInternal, tag), p, false});
    }
    for (int i = 1; i < size; ++i) {  // start with the next rank, so no peer is everyone's first
      const int p = (me + i) % size;
      if (send_bytes[p] == 0) continue;
      Buffer b{sbase + send_off[p], static_cast<std::size_t>(send_bytes[p]), send_mem};
      posted.push_back({comm_->post_send(&b, 1, p, TagKind::kInternal, tag), p, true});
    }
    if (send_bytes[me] > 0) {
      recv.narrow(0, recv_offsets[me], send_bytes[me]).copy_(send.narrow(0, send_off[me], send_bytes[me]));
    }
    // Every request is waited for, even after one failed: this rank's sends must reach the ranks
    // that wait for them (so they fail or finish promptly, not at their timeout).
    std::exception_ptr first;
    for (auto& p : posted) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      try {
        p.request.wait(std::max(left, std::chrono::milliseconds(1)));
        if (!p.is_send) received[p.peer] = static_cast<std::int64_t>(p.request.bytes());
      } catch (const Error& err) {
        if (err.code() == Errc::kTimeout) {
          throw Error(Errc::kTimeout,
                      std::string("timed out after ") + std::to_string(limit.count()) +
                          " ms waiting for the " + (p.is_send ? "send to" : "message from") + " rank " +
                          std::to_string(p.peer) + ": has every rank of the group made the same call? "
                          "(cancelled)");
        }
        if (err.code() == Errc::kTruncated && !p.is_send) {
          received[p.peer] = -1;  // longer than its slot: the caller says what that means
        } else if (!first) {
          first = std::current_exception();
        }
      }
    }
    if (first) std::rethrow_exception(first);
  } catch (...) {
    // Nothing may stay posted into (or from) memory the caller may reuse: cancel what is left and
    // let the backend keep both buffers alive until UCX is done with each request.
    for (auto& p : posted) {
      if (p.request.done()) continue;
      p.request.cancel();
      auto w = c10::make_intrusive<P2PWork>(me, p.is_send ? c10d::OpType::SEND : c10d::OpType::RECV,
                                            p.request, std::vector<at::Tensor>{send, recv}, timeout_);
      std::lock_guard<std::mutex> lk(mu_);
      reap_locked();
      inflight_.push_back(w);
    }
    try {
      throw;
    } catch (const Error& err) {
      const std::string msg = "commux " + op + " (" + where() + "): " + err.what();
      if (err.code() == Errc::kInvalidArgument || err.code() == Errc::kUnsupported) {
        C10_THROW_ERROR(ValueError, msg);
      }
      C10_THROW_ERROR(DistBackendError, msg);
    }
  }
  return received;
}

}  // namespace commux
