#include "device.hpp"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

#include "commux/error.hpp"
#include "../core/backoff.hpp"
#include "errors.hpp"
#include "types.hpp"

#ifndef COMMUX_DEVICE_TENSORS
#define COMMUX_DEVICE_TENSORS 1
#endif

namespace commux::c10d_detail {

namespace {

// What the process's UCX can carry (RuntimeInfo: its memory types and version).
struct UcxRuntime {
  std::mutex mu;
  bool known = false;
  RuntimeInfo info;
};

UcxRuntime& ucx_runtime() {
  static UcxRuntime r;
  return r;
}

// What a user needs to carry tensors of this kind, for the error message.
const char* how_to_get(MemoryType m) {
  switch (m) {
    case MemoryType::kCuda:
      return "install a UCX with the CUDA transports (pip install 'libucx-cu13>=1.22,<1.23', which "
             "commux's pip install uses by default, or a UCX configured --with-cuda) and build "
             "commux against it; if UCX_TLS is set, it must allow cuda_copy";
    case MemoryType::kRocm:
      return "use a UCX configured --with-rocm and build commux against it "
             "(-DCOMMUX_UCX_PROVIDER=system); if UCX_TLS is set, it must allow rocm_copy";
    case MemoryType::kZe:
      return "use a UCX (1.15 or newer) configured --with-ze and build commux against it "
             "(-DCOMMUX_UCX_PROVIDER=system); if UCX_TLS is set, it must allow ze_copy";
    default: return "use a UCX built for this accelerator";
  }
}

// coll::DeviceOps with ATen on the backend's stream of one device. Every call synchronizes that
// stream before it returns (the collectives hand the result to UCX next).
class AtenDeviceOps final : public coll::DeviceOps {
 public:
  AtenDeviceOps(c10::Device device, c10::Stream stream) : device_(device), stream_(stream) {}

  void synchronize() override { stream_.synchronize(); }

  void* allocate(std::size_t bytes) override {
    c10::StreamGuard g(stream_);  // the caching allocator ties the block to our stream
    at::Tensor t = at::empty({static_cast<int64_t>(std::max<std::size_t>(bytes, 1))},
                             at::TensorOptions().dtype(at::kByte).device(device_));
    void* p = t.data_ptr();
    live_.emplace(p, std::move(t));
    return p;
  }

  void release(void* p) noexcept override { live_.erase(p); }

  void reduce(void* out, const void* a, const void* b, std::size_t count, DataType t,
              ReduceOp op) override {
    c10::StreamGuard g(stream_);
    at::Tensor o = view(out, count, t), x = view(a, count, t), y = view(b, count, t);
    const bool logical = t == DataType::kBool;
    switch (op) {
      case ReduceOp::kSum: logical ? at::logical_or_out(o, x, y) : at::add_out(o, x, y); break;
      case ReduceOp::kProduct: logical ? at::logical_and_out(o, x, y) : at::mul_out(o, x, y); break;
      case ReduceOp::kMin: logical ? at::logical_and_out(o, x, y) : at::minimum_out(o, x, y); break;
      case ReduceOp::kMax: logical ? at::logical_or_out(o, x, y) : at::maximum_out(o, x, y); break;
      case ReduceOp::kBand: at::bitwise_and_out(o, x, y); break;
      case ReduceOp::kBor: at::bitwise_or_out(o, x, y); break;
      case ReduceOp::kBxor: at::bitwise_xor_out(o, x, y); break;
    }
    stream_.synchronize();
  }

  void copy(void* dst, MemoryType dst_mem, const void* src, MemoryType src_mem,
            std::size_t bytes) override {
    c10::StreamGuard g(stream_);
    at::Tensor d = bytes_view(dst, bytes, dst_mem), s = bytes_view(src, bytes, src_mem);
    d.copy_(s);
    stream_.synchronize();
  }

 private:
  at::Tensor view(const void* p, std::size_t count, DataType t) const {
    return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(count)},
                         at::TensorOptions().dtype(scalar_type(t)).device(device_));
  }
  at::Tensor bytes_view(const void* p, std::size_t bytes, MemoryType m) const {
    const c10::Device where = m == MemoryType::kHost ? c10::Device(c10::kCPU) : device_;
    return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(bytes)},
                         at::TensorOptions().dtype(at::kByte).device(where));
  }

  c10::Device device_;
  c10::Stream stream_;
  std::map<void*, at::Tensor> live_;  // scratch handed out, by address
};

}  // namespace

bool device_tensors_enabled() noexcept { return COMMUX_DEVICE_TENSORS != 0; }

void set_ucx_runtime(const RuntimeInfo& info) {
  auto& r = ucx_runtime();
  std::lock_guard<std::mutex> lk(r.mu);
  if (r.known) return;
  r.known = true;
  r.info = info;
}

MemoryType memory_type_of(const char* op, const at::Tensor& t, const char* what) {
  const c10::Device dev = t.device();
  if (dev.is_cpu()) return MemoryType::kHost;
  MemoryType m;
  switch (dev.type()) {
    case c10::DeviceType::CUDA:
      // ROCm builds of torch call their GPUs "cuda" too; UCX must be told ROCm memory.
      m = at::detail::getCUDAHooks().hasROCM() ? MemoryType::kRocm : MemoryType::kCuda;
      break;
    case c10::DeviceType::XPU: m = MemoryType::kZe; break;
    default:
      invalid(op, std::string(what) + " is on " + dev.str() +
                      ": commux carries CPU, CUDA, ROCm and Intel XPU tensors only");
  }
  if (!device_tensors_enabled()) {
    invalid(op, std::string(what) + " is on " + dev.str() +
                    ", but this commux was built with COMMUX_CUDA=OFF (CPU tensors only); "
                    "rebuild it with -DCOMMUX_CUDA=ON to carry device tensors");
  }
  auto& known = ucx_runtime();
  std::lock_guard<std::mutex> lk(known.mu);
  if (known.known && !known.info.supports(m)) {
    std::string have;
    for (const auto& s : known.info.memory_types) have += (have.empty() ? "" : ", ") + s;
    invalid(op, std::string(what) + " is on " + dev.str() + ", but the UCX in use (" +
                    known.info.ucx_version + ") cannot carry " + memory_type_name(m) +
                    " memory (the memory types it supports: " + have + "): " + how_to_get(m));
  }
  return m;
}

StreamFence::StreamFence(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> seen;
  for (const auto& t : tensors) {
    if (!on_device(t)) continue;
    const c10::Device d = t.device();
    if (std::find(seen.begin(), seen.end(), d) != seen.end()) continue;
    seen.push_back(d);
    const c10::impl::VirtualGuardImpl impl(d.type());
    const c10::Stream current = impl.getStream(d);
    // An idle stream has nothing the operation could overtake: no event needed (the common case
    // of a tensor produced a while ago costs one stream query instead of an event round trip).
    if (current.query()) continue;
    c10::Event ev(d.type());
    ev.record(current);
    events_.push_back(std::move(ev));
    devices_.push_back(d);
  }
}

void StreamFence::wait(std::chrono::steady_clock::time_point deadline, const char* op) const {
  using Clock = std::chrono::steady_clock;
  for (std::size_t i = 0; i < events_.size(); ++i) {
    // Poll the event: yield for the first 100 us (a kernel about to finish), then sleep in naps
    // that grow by a quarter up to kEventPollCap, and in a wait of more than 16 ms up to
    // kEventPollLongCap (core/backoff.hpp: the stream's end is seen at most about a quarter of
    // the wait late, never more than 250 us in the first 16 ms nor 1/64 of a longer wait), so
    // that the wait honours the deadline (Event::synchronize has none).
    const auto spin_until = Clock::now() + std::chrono::microseconds(100);
    detail::PollBackoff nap(std::chrono::microseconds(20), detail::kEventPollCap,
                            detail::kEventPollLongCap);
    while (!events_[i].query()) {
      const auto now = Clock::now();
      if (now >= deadline) {
        throw Error(Errc::kTimeout, std::string("commux ") + op +
                                        ": the work queued on the current stream of " +
                                        devices_[i].str() +
                                        " before the operation did not finish before the "
                                        "operation's deadline; nothing was posted");
      }
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap.next());
      }
    }
  }
}

bool StreamFence::reached() const {
  for (const auto& ev : events_) {
    if (!ev.query()) return false;
  }
  return true;
}

std::string StreamFence::describe() const {
  std::string devs;
  for (const auto& d : devices_) devs += (devs.empty() ? "" : ", ") + d.str();
  return "the work queued on the current stream of " + devs + " before the operation";
}

namespace {
class FenceGate final : public detail::Gate {
 public:
  explicit FenceGate(StreamFence fence) : fence_(std::move(fence)) {}
  bool open() override { return fence_.reached(); }
  std::string describe() const override { return fence_.describe(); }

 private:
  StreamFence fence_;
};
}  // namespace

std::shared_ptr<detail::Gate> fence_gate(StreamFence fence) {
  return std::make_shared<FenceGate>(std::move(fence));
}

struct DeviceStreams::PerDevice {
  c10::Stream stream;
  AtenDeviceOps ops;
  PerDevice(c10::Device d, c10::Stream s) : stream(s), ops(d, s) {}
};

DeviceStreams::DeviceStreams() = default;
DeviceStreams::~DeviceStreams() = default;

DeviceStreams::PerDevice& DeviceStreams::get(const c10::Device& device) {
  const auto key =
      std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = devices_.find(key);
  if (it == devices_.end()) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    // A pool stream of the device (CPU, for COMMUX_ATEN_REDUCE, has only its default stream).
    const c10::Stream s = device.is_cpu()
                              ? impl.getStream(device)
                              : impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
    it = devices_.emplace(key, std::make_unique<PerDevice>(device, s)).first;
  }
  return *it->second;
}

coll::DeviceOps* DeviceStreams::ops(const c10::Device& device) { return &get(device).ops; }

c10::Stream DeviceStreams::stream(const c10::Device& device) { return get(device).stream; }

void DeviceStreams::sync(const c10::Device& device) { get(device).stream.synchronize(); }

void DeviceStreams::record(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (!on_device(t) || !t.has_storage()) continue;
    const c10::impl::VirtualGuardImpl impl(t.device().type());
    impl.recordDataPtrOnStream(t.storage().data_ptr(), stream(t.device()));
  }
}

}  // namespace commux::c10d_detail
