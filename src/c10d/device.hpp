// src/c10d/device.hpp -- device tensors (CUDA, ROCm, Intel XPU) in the torch backend (internal).
//
// Everything here goes through torch's device-generic API (c10::Stream, c10::Event,
// c10::impl::VirtualGuardImpl, ATen operators), not through the CUDA runtime: one source serves
// CUDA, ROCm (whose torch reports device type "cuda") and XPU, compiles against a CPU-only torch,
// and the extension links no accelerator library of its own. The memory type UCX is told comes
// from the tensor's device (memory_type_of).
//
// Ordering, for a device tensor handed to an operation:
//   * before UCX reads or writes it: a StreamFence records an event on the current stream of the
//     tensor's device when the operation is issued. A collective's thread waits on that event (a
//     host wait on one event, never a device synchronize); a point-to-point operation returns at
//     once and its post is held back in core until the event has fired (fence_gate), polled by
//     whoever progresses, in call order with the group's other point-to-point posts;
//   * device work a collective does itself (reductions, packing, scaling) runs on a stream of the
//     backend's own (DeviceStreams) and is synchronized before UCX reads its result and before the
//     operation completes, so after wait() the data is visible to every stream;
//   * tensors stay referenced by the Work / Task until the operation is done, and the ones the
//     backend's stream touched are recorded on that stream (recordStream), so the caching allocator
//     never hands their memory to someone else while a kernel of ours may still use it.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "../core/channel.hpp"

namespace commux::c10d_detail {

// Whether this build carries device tensors (CMake option COMMUX_CUDA, default ON).
bool device_tensors_enabled() noexcept;

// What the process's UCX can carry (RuntimeInfo::supports, the check core makes before it
// posts), recorded by the first backend started (one UCX per process). Until then every device
// type is assumed supported (core and UCX themselves reject what they cannot carry).
void set_ucx_runtime(const RuntimeInfo& info);

// The memory type UCX is told for `t`. Throws c10::ValueError naming `op` and `what` when commux
// cannot carry the tensor's device: a device type it does not know, a build without device
// tensors, or a UCX without that memory type (with how to get one that has it).
MemoryType memory_type_of(const char* op, const at::Tensor& t, const char* what);

// Whether `t` lives in device memory (anything but the CPU).
inline bool on_device(const at::Tensor& t) { return t.defined() && !t.device().is_cpu(); }

// Events recorded on the current streams of the devices of some tensors (one per device).
class StreamFence {
 public:
  StreamFence() = default;
  // Records now, on the calling thread's current stream of each device among `tensors` (none for
  // a stream that is already idle).
  explicit StreamFence(const std::vector<at::Tensor>& tensors);
  bool empty() const { return events_.empty(); }
  // Blocks the calling thread until every stream has reached its event, or until `deadline`:
  // then throws commux::Error(kTimeout) naming `op` and the device (a hung or endless kernel
  // before the operation must not hang the caller or the worker thread).
  void wait(std::chrono::steady_clock::time_point deadline, const char* op) const;
  // Whether every stream has reached its event (polls, never blocks).
  bool reached() const;
  // "the work queued on cuda:0's current stream before the operation".
  std::string describe() const;

 private:
  std::vector<c10::Event> events_;
  std::vector<c10::Device> devices_;
};

// A gate (core's Channel::post_after) that opens once `fence` is reached: a point-to-point
// post of a device tensor waits for its stream's work without blocking the caller.
std::shared_ptr<detail::Gate> fence_gate(StreamFence fence);

// The backend's own stream per device, where it runs its device work, plus a coll::DeviceOps per
// device that runs the collectives' reductions and copies there with ATen. Used by the worker
// thread only.
class DeviceStreams {
 public:
  DeviceStreams();
  ~DeviceStreams();
  DeviceStreams(const DeviceStreams&) = delete;
  DeviceStreams& operator=(const DeviceStreams&) = delete;
  // The DeviceOps (and stream) of `device`, created on first use.
  coll::DeviceOps* ops(const c10::Device& device);
  c10::Stream stream(const c10::Device& device);
  // Synchronizes the backend's stream of `device` (work queued there is complete on return).
  void sync(const c10::Device& device);
  // Tells the caching allocator that the backend's stream of the tensors' device uses them.
  void record(const std::vector<at::Tensor>& tensors);

 private:
  struct PerDevice;
  PerDevice& get(const c10::Device& device);
  std::map<std::pair<int, int>, std::unique_ptr<PerDevice>> devices_;
};

}  // namespace commux::c10d_detail
