// The CUDA runtime for the test driver's CUDA mode (UCXPG_DEVICE=cuda), loaded at run time with
// dlopen: neither commux nor its tests link CUDA or include a CUDA header, so the driver builds
// and runs (and skips its CUDA mode) on machines without CUDA.
//
// The library tried, in order: $COMMUX_CUDART (a path, e.g. /usr/local/cuda/lib64/libcudart.so.12),
// then libcudart.so.13, libcudart.so.12 and libcudart.so by name (the dynamic loader's search path:
// LD_LIBRARY_PATH, ldconfig). The first that loads, has every function used here and sees at least
// one device wins (a runtime too new for the driver reports an error and the next is tried).
// Test-only: a failing CUDA call throws std::runtime_error naming the call and CUDA's message.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "checks.hpp"

namespace commux::test {

class CudaRuntime {
 public:
  // Loads the runtime, makes device `ordinal % device count` current on the calling thread and
  // creates its (primary) context. Returns nullptr, with what is missing in *why, when no runtime
  // can be loaded or no device is visible.
  static std::unique_ptr<CudaRuntime> open(int ordinal, std::string* why);
  // Keeps the library loaded: CUDA tears its state down at process exit.
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  const std::string& library() const { return library_; }
  int device() const { return device_; }
  int device_count() const { return count_; }

  void* alloc(std::size_t bytes);  // cudaMalloc
  void release(void* p) noexcept;  // cudaFree; reports a failure on stderr (runs in destructors)
  // cudaMemcpy host to device / device to host. Both return with the bytes in place (device work
  // of every stream is synchronized first / after as needed).
  void to_device(void* dst, const void* src, std::size_t bytes);
  void to_host(void* dst, const void* src, std::size_t bytes);
  void fill(void* dst, int value, std::size_t bytes);  // cudaMemset, then synchronized
  void synchronize();                                  // cudaDeviceSynchronize

  struct Api;  // the runtime's functions (cuda_shim.cpp)

 private:
  CudaRuntime() = default;
  void check(int err, const char* call) const;

  std::unique_ptr<Api> api_;
  std::string library_;
  int device_ = -1;
  int count_ = 0;
};

// Device memory of one CudaRuntime for the checks (MemoryType::kCuda).
class CudaSpace final : public Space {
 public:
  explicit CudaSpace(CudaRuntime& rt) : rt_(rt) {}
  MemoryType type() const override { return MemoryType::kCuda; }
  void* allocate(std::size_t bytes) override;
  void release(void* p) noexcept override;
  void upload(void* dst, const void* host_src, std::size_t bytes) override;
  void download(void* host_dst, const void* src, std::size_t bytes) override;

 private:
  CudaRuntime& rt_;
};

}  // namespace commux::test
