// ProcessGroupUCX::exchange_lanes (its Impl's): the sparse all-to-all under commux.ep
// (expert-parallel dispatch and combine). Everything happens on the calling thread: no worker-thread hand-off, one message
// per peer that has bytes to receive, self's part copied locally.
//
// Tags: each call takes one internal tag from the group's collective sequence (next_tag_), the
// same counter collectives draw from, so an exchange can never match user point-to-point traffic
// (the internal bit), a collective's messages, another exchange (another Buffer's included) or a
// later call's (the sequence number: its low 16 bits and a fingerprint of its own, as for a
// collective's messages: coll::call_wire_tag). Every rank of the group must issue the same sequence of
// collectives and exchanges -- the rule collectives already have.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <string>
#include <vector>

#include "commux/process_group_ucx.hpp"
#include "../core/channel.hpp"
#include "device.hpp"
#include "errors.hpp"
#include "process_group_ucx_internal.hpp"
#include "work.hpp"

namespace {
constexpr std::uint64_t kExchangeFingerprint = 0x65705f6578636867ull;  // "ep_exchg"
}  // namespace

namespace commux {

using c10d_detail::Clock;
using c10d_detail::memory_type_of;
using c10d_detail::on_device;
using c10d_detail::P2PWork;
using c10d_detail::StreamFence;

namespace {

[[noreturn]] void bad(const std::string& op, const std::string& what) {
  c10d_detail::throw_value_error("commux " + op + ": " + what);
}

// The sum of `bytes`, one entry per rank, each in 0 .. `limit` (the buffer's bytes: so that
// neither the sum nor an offset plus a capacity can wrap around int64 into a plausible value, as
// entries near 2^62 once did).
std::int64_t checked_total(const std::string& op, const std::vector<std::int64_t>& bytes,
                           const char* what, int size, std::int64_t limit) {
  if (static_cast<int>(bytes.size()) != size) {
    bad(op, std::string(what) + " has " + std::to_string(bytes.size()) +
                " entries, the group has " + std::to_string(size) + " ranks");
  }
  std::int64_t total = 0;
  for (std::size_t p = 0; p < bytes.size(); ++p) {
    if (bytes[p] < 0) bad(op, std::string(what) + "[" + std::to_string(p) + "] is negative");
    if (bytes[p] > limit) {
      bad(op, std::string(what) + "[" + std::to_string(p) + "] is " + std::to_string(bytes[p]) +
                  ", beyond the buffer's " + std::to_string(limit) + " bytes");
    }
    total += bytes[p];
  }
  return total;
}

}  // namespace

std::vector<std::int64_t> ProcessGroupUCX::Impl::exchange_lanes(
    const std::string& op, const std::vector<at::Tensor>& sends,
    const std::vector<std::vector<std::int64_t>>& send_bytes, const std::vector<at::Tensor>& recvs,
    const std::vector<std::vector<std::int64_t>>& recv_offsets,
    const std::vector<std::vector<std::int64_t>>& recv_capacity,
    std::chrono::milliseconds timeout) {
  const int size = getSize();
  const int me = getRank();
  const std::size_t L = sends.size();
  if (L == 0 || send_bytes.size() != L || recvs.size() != L || recv_offsets.size() != L ||
      recv_capacity.size() != L) {
    bad(op,
        "needs the same number (>= 1) of send tensors, send sizes, receive tensors, offsets and "
        "capacities");
  }
  std::vector<std::vector<std::int64_t>> send_off(L);
  std::vector<MemoryType> send_mem(L), recv_mem(L);
  std::vector<at::Tensor> all;
  for (std::size_t l = 0; l < L; ++l) {
    for (const auto* t : {&sends[l], &recvs[l]}) {
      if (!t->defined() || t->scalar_type() != at::kByte || t->dim() != 1 || !t->is_contiguous()) {
        bad(op, std::string(t == &sends[l] ? "a send" : "a receive") +
                    " buffer must be a contiguous 1-D uint8 tensor");
      }
      all.push_back(*t);
    }
    const std::int64_t send_total =
        checked_total(op, send_bytes[l], "send_bytes", size, sends[l].numel());
    checked_total(op, recv_capacity[l], "recv_capacity", size, recvs[l].numel());
    checked_total(op, recv_offsets[l], "recv_offsets", size, recvs[l].numel());
    if (send_total != sends[l].numel()) {
      bad(op, "send_bytes add up to " + std::to_string(send_total) +
                  " bytes, the send buffer holds " + std::to_string(sends[l].numel()));
    }
    for (int p = 0; p < size; ++p) {
      if (recv_offsets[l][p] + recv_capacity[l][p] > recvs[l].numel()) {
        bad(op,
            "the receive slot of rank " + std::to_string(p) + " lies outside the receive buffer");
      }
    }
    if (send_bytes[l][me] > recv_capacity[l][me]) {
      bad(op, "this rank sends itself " + std::to_string(send_bytes[l][me]) +
                  " bytes, more than its " + std::to_string(recv_capacity[l][me]) + "-byte slot");
    }
    send_off[l].assign(size + 1, 0);
    for (int p = 0; p < size; ++p) send_off[l][p + 1] = send_off[l][p] + send_bytes[l][p];
    auto mem_of = [&](const at::Tensor& t) {
      return on_device(t) ? memory_type_of(op.c_str(), t, "tensor") : MemoryType::kHost;
    };
    send_mem[l] = mem_of(sends[l]);
    recv_mem[l] = mem_of(recvs[l]);
  }
  std::uint32_t tag = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) bad(op, "the process group (" + where() + ") has been shut down");
    // The wire tag of the call, with the exchange's own fingerprint and the number of lanes: its
    // messages never match a collective's (src/collectives/calls.cpp), nor an exchange of another
    // lane count (whose parts would land in the wrong lanes).
    tag = coll::call_wire_tag(next_tag_++, kExchangeFingerprint ^ (0x9E3779B97F4A7C15ull * L));
  }
  const auto limit = effective(timeout);
  const auto deadline = Clock::now() + limit;

  std::vector<std::int64_t> received(size, 0);
  for (std::size_t l = 0; l < L; ++l) received[me] += send_bytes[l][me];
  struct Posted {
    Request request;
    int peer;
    bool is_send;
  };
  std::vector<Posted> posted;
  posted.reserve(2 * static_cast<std::size_t>(size));
  // One message per peer: a part per lane, the empty ones too. (Leaving them out relied on the
  // sender's sizes and the receiver's capacities having the same zeros; where they did not, a
  // lane's bytes landed in another lane's slot, and the call could even succeed.)
  std::vector<Buffer> parts(L);
  auto gather = [&](int p, bool is_send) {
    for (std::size_t l = 0; l < L; ++l) {
      const std::int64_t bytes = is_send ? send_bytes[l][p] : recv_capacity[l][p];
      auto* base = static_cast<std::uint8_t*>(is_send ? sends[l].data_ptr() : recvs[l].data_ptr());
      parts[l] =
          Buffer{base == nullptr ? nullptr : base + (is_send ? send_off[l][p] : recv_offsets[l][p]),
                 static_cast<std::size_t>(bytes), is_send ? send_mem[l] : recv_mem[l]};
    }
    return L;
  };
  try {
    // UCX reads the send buffers and overwrites the receive buffers from now on: the work queued
    // on their streams must be complete.
    bool device = false;
    for (std::size_t l = 0; l < L; ++l)
      device = device || send_mem[l] != MemoryType::kHost || recv_mem[l] != MemoryType::kHost;
    if (device) StreamFence(all).wait(deadline, op.c_str());
    for (int p = 0; p < size; ++p) {
      if (p == me) continue;
      const std::size_t n = gather(p, false);
      posted.push_back(
          {commux::detail::channel(*comm_).post_recv(parts.data(), n, p, TagKind::kInternal, tag),
           p, false});
    }
    for (int i = 1; i < size; ++i) {  // start with the next rank, so no peer is everyone's first
      const int p = (me + i) % size;
      const std::size_t n = gather(p, true);
      // Waited on at once: UCX may then stay eager up to its fast-completion threshold.
      posted.push_back(
          {commux::detail::channel(*comm_).post_send(parts.data(), n, p, TagKind::kInternal, tag,
                                                     /*fast_completion=*/true),
           p, true});
    }
    for (std::size_t l = 0; l < L; ++l) {
      const std::int64_t n = send_bytes[l][me];
      if (n == 0) continue;
      if (send_mem[l] == MemoryType::kHost && recv_mem[l] == MemoryType::kHost) {
        std::memcpy(static_cast<std::uint8_t*>(recvs[l].data_ptr()) + recv_offsets[l][me],
                    static_cast<const std::uint8_t*>(sends[l].data_ptr()) + send_off[l][me],
                    static_cast<std::size_t>(n));
      } else {
        recvs[l].narrow(0, recv_offsets[l][me], n).copy_(sends[l].narrow(0, send_off[l][me], n));
      }
    }
    // Every request is waited for, even after one failed: this rank's sends must reach the ranks
    // that wait for them (so they fail or finish promptly, not at their timeout).
    std::exception_ptr first;
    for (auto& p : posted) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      try {
        p.request.wait(std::max(left, std::chrono::milliseconds(1)));
        if (!p.is_send) received[p.peer] = static_cast<std::int64_t>(p.request.bytes());
      } catch (const Error& err) {
        if (err.code() == Errc::kTimeout) {
          throw Error(Errc::kTimeout, std::string("Timed out after ") +
                                          std::to_string(limit.count()) + " ms waiting for the " +
                                          (p.is_send ? "send to" : "message from") + " rank " +
                                          std::to_string(p.peer) +
                                          ": has every rank of the group made the same call? "
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
    // let the backend keep the buffers alive until UCX is done with each request.
    for (auto& p : posted) {
      if (p.request.done()) continue;
      p.request.cancel();
      auto w = c10::make_intrusive<P2PWork>(me, p.is_send ? c10d::OpType::SEND : c10d::OpType::RECV,
                                            p.request, all, timeout_);
      keep_until_done(w);
    }
    try {
      throw;
    } catch (const Error& err) {
      const std::string msg = "commux " + op + " (" + where() + "): " + err.what();
      if (err.code() == Errc::kInvalidArgument || err.code() == Errc::kUnsupported) {
        c10d_detail::throw_value_error(msg);
      }
      c10d_detail::throw_backend_error(msg);
    }
  }
  return received;
}

}  // namespace commux
