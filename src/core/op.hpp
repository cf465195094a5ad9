// Private to src/core: one posted operation (Op) and its UCX messages (Part).
//
// Ownership: an Op does not own the user's buffers (the caller keeps them alive until the Request
// finishes); it owns its IOV descriptors and its Parts, whose addresses UCX holds as user data
// while they are in flight. While in flight an Op owns itself (`self`) and sits in the worker's
// in-flight list (worker.hpp); finishing unregisters it. A Request shares the Op; the Op shares
// its Engine, so the Engine (with its worker and wake fd) outlives every Op and every waiter.
// Locks: fields marked [mu] are guarded by the worker mutex (Worker::mutex()). The posting and
// completion code is Engine's, in op.cpp.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "channel.hpp"
#include "commux/communicator.hpp"

namespace commux::detail {

class Engine;

// A vector that keeps its first element inline: the common single-buffer operation then costs no
// allocation besides its Op.
template <typename T>
class SmallVec {
 public:
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T* data() noexcept { return heap_ ? heap_.get() : &inline_; }
  const T* data() const noexcept { return heap_ ? heap_.get() : &inline_; }
  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }
  T* begin() noexcept { return data(); }
  T* end() noexcept { return data() + size_; }
  const T* begin() const noexcept { return data(); }
  const T* end() const noexcept { return data() + size_; }
  void resize(std::size_t n) {  // only on an empty SmallVec
    if (n > 1) heap_.reset(new T[n]());
    size_ = n;
  }

 private:
  T inline_{};
  std::unique_ptr<T[]> heap_;
  std::size_t size_ = 0;
};

struct Part {
  struct Op* op = nullptr;
  std::uint32_t index = 0;
  void* ucx_req = nullptr;     // [mu] in-flight UCX request, or nullptr
  bool posting = false;        // [mu] inside its ucp_*_nbx call; the callback clears it
  ucp_tag_recv_info_t info{};  // receive info of an immediately completed receive
};

struct Op final : RequestState {
  enum class Kind : std::uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  const char* name = "";  // operation name for messages ("isend", "irecv", ...)
  int peer = 0;           // requested peer, kAnySource for any-source receives
  TagKind tag_kind = TagKind::kUser;
  std::uint32_t tag = 0;
  Packing packing = Packing::kParts;  // how this op travels (kIov only when > 1 buffer)
  std::size_t capacity = 0;           // total bytes of the posted buffers
  SmallVec<Buffer> buffers;           // the user's buffers (not owned)
  std::vector<ucp_dt_iov_t> iov;      // IOV descriptors, alive until completion
  SmallVec<Part> parts;               // fixed size once posted (pointers into it go to UCX)
  std::shared_ptr<Engine> engine;
  // [mu] While in flight the Op owns itself and sits in the worker's in-flight list.
  std::shared_ptr<Op> self;
  Op* prev = nullptr;
  Op* next = nullptr;

  // [mu] Held back by Channel::post_after: registered (waits, cancel, shutdown and peer failure
  // see it) but not yet given to UCX, which holds none of its parts. `gate` is what it waits
  // for (none: only for an earlier held post it must not overtake); Engine::release_held_locked
  // posts it once the gate is open and those are out.
  bool held = false;
  std::shared_ptr<Gate> gate;
  bool fast_completion = false;

  std::atomic<bool> done{false};
  // Written under the worker mutex before `done` is set, read after it is seen set.
  int remaining = 0;                      // [mu] UCX messages not yet complete
  ucs_status_t status = UCS_OK;           // [mu] first failure
  Errc override_code = Errc::kTransport;  // [mu] set with has_override for peer failure/shutdown
  bool has_override = false;              // [mu]
  std::string override_reason;            // [mu]
  std::string detail;                     // [mu] extra facts for the error message
  int source = -1;                        // [mu] real sender (receives)
  std::size_t bytes = 0;                  // [mu] bytes moved
  // [mu] Finished (failed) for commux while UCX still holds some of its parts: the Engine keeps
  // it alive, off the in-flight list, until UCX completes them (Engine::fail_op_locked).
  bool parked = false;
  // [mu] When a peer failure first failed it while UCX was still using its buffers with a live
  // peer (see Peers::reap_locked); zero otherwise.
  std::chrono::steady_clock::time_point lingering_since{};
  // Set (under the mutex, read without it) when such an op has lingered too long: waits then
  // throw its error at once, while it stays posted and unfinished (UCX may still use its
  // buffers, so whoever owns them keeps them until it finishes).
  std::atomic<bool> abandoned{false};
  std::exception_ptr error;  // set once when finished

  // Cancels every part still in flight in UCX (each then completes with UCS_ERR_CANCELED). [mu]
  void cancel_parts_locked(ucp_worker_h worker) noexcept {
    for (Part& p : parts) {
      if (p.ucx_req != nullptr) ucp_request_cancel(worker, p.ucx_req);
    }
  }

  // RequestState
  bool test() override;
  void wait_for(std::chrono::milliseconds timeout) override;
  bool await(std::chrono::milliseconds timeout, bool spin, bool goes_on) override;
  void request_cancel() override;
  bool finished() const noexcept override { return done.load(); }
  int posted_peer() const noexcept override { return peer; }
  int sender() const noexcept override { return source; }
  std::size_t transferred() const noexcept override { return bytes; }
  std::exception_ptr failure() const noexcept override { return error; }
  std::chrono::milliseconds default_timeout() const noexcept override;
};

}  // namespace commux::detail
