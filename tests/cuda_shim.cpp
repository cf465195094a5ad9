#include "cuda_shim.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "commux/settings.hpp"

namespace commux::test {

namespace {

// The little of the CUDA runtime API used here, declared by hand (cuda_runtime_api.h): every call
// returns a cudaError_t, 0 being cudaSuccess; cudaMemcpyKind 1 is host to device, 2 device to host.
using cudaError = int;
constexpr cudaError kCudaSuccess = 0;
constexpr int kMemcpyHostToDevice = 1;
constexpr int kMemcpyDeviceToHost = 2;

}  // namespace

struct CudaRuntime::Api {
  void* handle = nullptr;  // from dlopen; never closed
  cudaError (*GetDeviceCount)(int*) = nullptr;
  cudaError (*SetDevice)(int) = nullptr;
  cudaError (*Malloc)(void**, std::size_t) = nullptr;
  cudaError (*Free)(void*) = nullptr;
  cudaError (*Memcpy)(void*, const void*, std::size_t, int) = nullptr;  // kind: cudaMemcpyKind
  cudaError (*Memset)(void*, int, std::size_t) = nullptr;
  cudaError (*DeviceSynchronize)() = nullptr;
  const char* (*GetErrorString)(cudaError) = nullptr;

  std::string error(cudaError err) const {
    const char* s = GetErrorString != nullptr ? GetErrorString(err) : nullptr;
    return std::string(s != nullptr ? s : "unknown error") + " (cudaError " + std::to_string(err) +
           ")";
  }
};

namespace {

template <class F>
bool resolve(void* handle, const char* name, F& fn, std::string* missing) {
  void* p = ::dlsym(handle, name);
  if (p == nullptr) {
    *missing += *missing == "" ? name : std::string(", ") + name;
    return false;
  }
  static_assert(sizeof(F) == sizeof(void*), "function and object pointers differ in size");
  std::memcpy(&fn, &p, sizeof fn);  // POSIX: dlsym's result may be used as a function pointer
  return true;
}

// Loads `lib` and resolves every function, or says why not.
std::unique_ptr<CudaRuntime::Api> load(const std::string& lib, std::string* why) {
  ::dlerror();
  void* h = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = ::dlerror();
    *why = e != nullptr ? e : "dlopen failed";
    if (why->compare(0, lib.size() + 2, lib + ": ") == 0) why->erase(0, lib.size() + 2);
    return nullptr;
  }
  auto api = std::make_unique<CudaRuntime::Api>();
  api->handle = h;
  std::string missing;
  // Evaluate every lookup (no short-circuit) so the message lists all missing functions.
  bool ok = resolve(h, "cudaGetDeviceCount", api->GetDeviceCount, &missing);
  ok = resolve(h, "cudaSetDevice", api->SetDevice, &missing) && ok;
  ok = resolve(h, "cudaMalloc", api->Malloc, &missing) && ok;
  ok = resolve(h, "cudaFree", api->Free, &missing) && ok;
  ok = resolve(h, "cudaMemcpy", api->Memcpy, &missing) && ok;
  ok = resolve(h, "cudaMemset", api->Memset, &missing) && ok;
  ok = resolve(h, "cudaDeviceSynchronize", api->DeviceSynchronize, &missing) && ok;
  ok = resolve(h, "cudaGetErrorString", api->GetErrorString, &missing) && ok;
  if (!ok) {
    *why = "loaded, but lacks " + missing;
    ::dlclose(h);
    return nullptr;
  }
  return api;
}

}  // namespace

CudaRuntime::~CudaRuntime() = default;

std::unique_ptr<CudaRuntime> CudaRuntime::open(int ordinal, std::string* why) {
  std::vector<std::string> candidates;
  const std::string& env = commux::settings().cudart;  // COMMUX_CUDART
  if (!env.empty()) candidates.emplace_back(env);
  for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    if (std::find(candidates.begin(), candidates.end(), name) == candidates.end()) {
      candidates.emplace_back(name);
    }
  }
  std::string tried;
  auto note = [&tried](const std::string& lib, const std::string& what) {
    tried += (tried.empty() ? "" : "; ") + lib + ": " + what;
  };
  for (const std::string& lib : candidates) {
    std::string reason;
    std::unique_ptr<Api> api = load(lib, &reason);
    if (!api) {
      note(lib, reason);
      continue;
    }
    // A runtime newer than the driver fails here (cudaErrorInsufficientDriver); the next
    // candidate may be older. A failed runtime stays loaded: unloading CUDA is not worth the risk.
    int count = 0;
    const cudaError err = api->GetDeviceCount(&count);
    if (err != kCudaSuccess) {
      note(lib, "cudaGetDeviceCount failed: " + api->error(err));
      continue;
    }
    if (count <= 0) {
      note(lib, "cudaGetDeviceCount sees no device");
      continue;
    }
    std::unique_ptr<CudaRuntime> rt(new CudaRuntime());
    rt->api_ = std::move(api);
    rt->library_ = lib;
    rt->count_ = count;
    rt->device_ = (ordinal < 0 ? 0 : ordinal) % count;
    // cudaSetDevice makes the device current on this thread; cudaFree(nullptr) creates its primary
    // context now (before UCX starts) rather than at the first allocation.
    cudaError e = rt->api_->SetDevice(rt->device_);
    if (e == kCudaSuccess) e = rt->api_->Free(nullptr);
    if (e != kCudaSuccess) {
      *why = lib + ": cannot use device " + std::to_string(rt->device_) + " of " +
             std::to_string(count) + ": " + rt->api_->error(e);
      return nullptr;
    }
    return rt;
  }
  *why = "no usable CUDA runtime (" + tried +
         "); set COMMUX_CUDART=/path/to/libcudart.so.N or put its directory on LD_LIBRARY_PATH";
  return nullptr;
}

void CudaRuntime::check(int err, const char* call) const {
  if (err != kCudaSuccess) {
    throw std::runtime_error(std::string(call) + " on device " + std::to_string(device_) +
                             " failed: " + api_->error(err));
  }
}

void* CudaRuntime::alloc(std::size_t bytes) {
  void* p = nullptr;
  check(api_->Malloc(&p, bytes), "cudaMalloc");
  if (p == nullptr) throw std::runtime_error("cudaMalloc returned no memory");
  return p;
}

void CudaRuntime::release(void* p) noexcept {
  const cudaError err = api_->Free(p);
  if (err != kCudaSuccess) std::fprintf(stderr, "cudaFree failed: %s\n", api_->error(err).c_str());
}

void CudaRuntime::to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  check(api_->Memcpy(dst, src, bytes, kMemcpyHostToDevice), "cudaMemcpy (host to device)");
  // From pageable memory, cudaMemcpy may return once the bytes are staged, before they reach the
  // device; UCX reads them on its own streams.
  synchronize();
}

void CudaRuntime::to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  synchronize();  // whatever wrote the device memory, on any stream, has finished
  check(api_->Memcpy(dst, src, bytes, kMemcpyDeviceToHost), "cudaMemcpy (device to host)");
}

void CudaRuntime::fill(void* dst, int value, std::size_t bytes) {
  if (bytes == 0) return;
  check(api_->Memset(dst, value, bytes), "cudaMemset");
  synchronize();
}

void CudaRuntime::synchronize() { check(api_->DeviceSynchronize(), "cudaDeviceSynchronize"); }

void* CudaSpace::allocate(std::size_t bytes) { return rt_.alloc(std::max<std::size_t>(bytes, 1)); }
void CudaSpace::release(void* p) noexcept { rt_.release(p); }
void CudaSpace::upload(void* dst, const void* host_src, std::size_t bytes) {
  rt_.to_device(dst, host_src, bytes);
}
void CudaSpace::download(void* host_dst, const void* src, std::size_t bytes) {
  rt_.to_host(host_dst, src, bytes);
}

}  // namespace commux::test
