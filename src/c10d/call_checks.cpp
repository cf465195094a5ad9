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
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "errors.hpp"
#include "process_group_ucx_internal.hpp"

namespace commux {

namespace {

// Calls after which a dead call's entry is dropped (its tag's low 16 bits are reused after 65536).
constexpr std::uint32_t kDeadFor = 60000;
// At most this many dead calls are remembered (the oldest goes first).
constexpr std::size_t kMaxDead = 64;

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

}  // namespace commux
