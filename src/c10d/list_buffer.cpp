// src/c10d/list_buffer.cpp -- see list_buffer.hpp.
#include "list_buffer.hpp"

#include <ATen/ATen.h>

#include "commux/collectives.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace commux::c10d_detail {

namespace {

// Per element at most this many bytes are copied with memcpy: below it torch's per-call cost
// dominates a copy, above it copy_ may split the copy over torch's threads.
constexpr std::size_t kMemcpyMax = 256 * 1024;

at::Tensor bytes_at(void* p, std::size_t n, c10::Device device) {
  return at::from_blob(p, {static_cast<int64_t>(n)},
                       at::TensorOptions().dtype(at::kByte).device(device));
}

// The process keeps the two largest host staging buffers of up to kKeepMax bytes each that
// finished calls gave back (all_to_all stages two), for later calls that need no more: a large
// buffer fresh from malloc is fresh mmap'd memory, and faulting its pages in cost more than the
// copies (a 2 x 16 MiB all_gather list took 28 ms against 4 ms for the same call on the rows of
// one tensor). Calls at once each take their own.
constexpr std::size_t kKeepMax = std::size_t{64} << 20;
constexpr std::size_t kKeepCount = 2;

struct Kept {
  std::mutex mu;
  std::unique_ptr<std::byte[]> buf[kKeepCount];
  std::size_t bytes[kKeepCount] = {};
  int users = 0;  // KeptStagingUser
};

Kept& kept() {
  static Kept* k = new Kept();  // never destroyed: calls may finish during exit
  return *k;
}

// At least `bytes`; *capacity says how many.
std::unique_ptr<std::byte[]> take_host(std::size_t bytes, std::size_t* capacity) {
  Kept& k = kept();
  {
    std::lock_guard<std::mutex> g(k.mu);
    std::size_t best = kKeepCount;  // the smallest kept buffer that is large enough
    for (std::size_t i = 0; i < kKeepCount; ++i) {
      if (k.buf[i] && k.bytes[i] >= bytes && (best == kKeepCount || k.bytes[i] < k.bytes[best])) {
        best = i;
      }
    }
    if (best != kKeepCount) {
      *capacity = k.bytes[best];
      k.bytes[best] = 0;
      return std::move(k.buf[best]);
    }
  }
  *capacity = bytes == 0 ? 1 : bytes;
  return std::unique_ptr<std::byte[]>(new std::byte[*capacity]);
}

void give_host(std::unique_ptr<std::byte[]> buf, std::size_t bytes) noexcept {
  if (bytes > kKeepMax) return;
  Kept& k = kept();
  std::lock_guard<std::mutex> g(k.mu);
  std::size_t slot = 0;  // an empty slot, else the smallest kept buffer
  for (std::size_t i = 0; i < kKeepCount; ++i) {
    if (!k.buf[i]) {
      slot = i;
      break;
    }
    if (k.bytes[i] < k.bytes[slot]) slot = i;
  }
  if (k.buf[slot] && k.bytes[slot] >= bytes) return;  // frees `buf`
  std::swap(k.buf[slot], buf);                        // frees the smaller one it replaces
  k.bytes[slot] = bytes;
}

}  // namespace

std::size_t kept_staging_bytes() noexcept {
  Kept& k = kept();
  std::lock_guard<std::mutex> g(k.mu);
  std::size_t sum = 0;
  for (std::size_t i = 0; i < kKeepCount; ++i) sum += k.buf[i] ? k.bytes[i] : 0;
  return sum;
}

KeptStagingUser::KeptStagingUser() noexcept {
  Kept& k = kept();
  std::lock_guard<std::mutex> g(k.mu);
  ++k.users;
}

KeptStagingUser::~KeptStagingUser() {
  std::unique_ptr<std::byte[]> freed[kKeepCount];  // freed after the lock is let go
  Kept& k = kept();
  std::lock_guard<std::mutex> g(k.mu);
  if (--k.users > 0) return;
  for (std::size_t i = 0; i < kKeepCount; ++i) {
    freed[i] = std::move(k.buf[i]);
    k.bytes[i] = 0;
  }
}

bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) noexcept {
  if (an == 0 || bn == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + bn && pb < pa + an;
}

std::pair<const void*, std::size_t> extent(const std::vector<at::Tensor>& list,
                                           const std::vector<std::size_t>& bytes) noexcept {
  std::uintptr_t lo = UINTPTR_MAX;
  std::uintptr_t hi = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (bytes[i] == 0) continue;
    const auto p = reinterpret_cast<std::uintptr_t>(list[i].data_ptr());
    lo = std::min(lo, p);
    hi = std::max(hi, p + bytes[i]);
  }
  if (hi == 0) return {nullptr, 0};
  return {reinterpret_cast<const void*>(lo), hi - lo};
}

ListBuffer::ListBuffer(const CallRef& call, const std::vector<at::Tensor>& list,
                       const std::vector<std::size_t>& bytes, const at::Tensor& like,
                       const void* other, std::size_t other_bytes, int own)
    : call_(call), list_(list), bytes_(bytes), displs_(list.size()) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    displs_[i] = total;
    total += bytes[i];
  }
  // The list as one block: each non-empty element right where the previous ones end.
  std::uintptr_t base = 0;
  bool started = false;
  bool block = total > 0;
  for (std::size_t i = 0; block && i < list.size(); ++i) {
    if (bytes[i] == 0) continue;
    const auto p = reinterpret_cast<std::uintptr_t>(list[i].data_ptr());
    if (!started) {
      started = true;
      base = p - displs_[i];
    }
    block = p == base + displs_[i];
  }
  if (block) {
    const bool own_slot = own >= 0 && static_cast<std::size_t>(own) < list.size() &&
                          reinterpret_cast<std::uintptr_t>(other) == base + displs_[own] &&
                          other_bytes == bytes[own];
    block = own_slot || !overlaps(reinterpret_cast<const void*>(base), total, other, other_bytes);
  }
  if (block) {
    data_ = reinterpret_cast<void*>(base);
    in_place_ = true;
  } else if (like.device().is_cpu()) {
    host_ = take_host(total, &host_bytes_);
    data_ = host_.get();
  } else {
    staging_ = at::empty({static_cast<int64_t>(total)},
                         at::TensorOptions().dtype(at::kByte).device(like.device()));
    data_ = staging_.data_ptr();
  }
}

ListBuffer::~ListBuffer() {
  if (done_) {
    if (host_) give_host(std::move(host_), host_bytes_);
    return;
  }
  // The call failed: transfers it left posted may still use the staging (a rank whose collective
  // timed out used to crash when its peer's receive came late, and the transport read the staging
  // memory freed here). (Out of memory in here ends the process: loud, where freeing is not safe.)
  if (host_) hold_for(call_, std::shared_ptr<const void>(std::move(host_)));
  if (staging_.defined()) hold_for(call_, std::make_shared<const at::Tensor>(std::move(staging_)));
}

void ListBuffer::copy(std::size_t i, bool in) {
  const std::size_t n = bytes_[i];
  if (n == 0) return;
  void* user = list_[i].data_ptr();
  void* mine = static_cast<std::byte*>(data_) + displs_[i];
  if (host_ && n <= kMemcpyMax) {
    std::memcpy(in ? mine : user, in ? user : mine, n);
    return;
  }
  const c10::Device device = list_[i].device();
  bytes_at(in ? mine : user, n, device).copy_(bytes_at(in ? user : mine, n, device));
}

void ListBuffer::pack() {
  if (in_place_) return;
  for (std::size_t i = 0; i < list_.size(); ++i) copy(i, true);
}

void ListBuffer::unpack() {
  done();
  if (in_place_) return;
  for (std::size_t i = 0; i < list_.size(); ++i) copy(i, false);
}

}  // namespace commux::c10d_detail
