// Private to src/core: the UCX context -- what UCX offers this process.
//
// Ownership: a Context owns its ucp_context_h from create() to destroy(). The Engine destroys it
// last, after the worker (a worker may not outlive its context); nothing else holds the handle.
// Threads: only create() and destroy() write the handle, on the thread that starts the Engine
// and, with the worker mutex held, the one that shuts it down; the worker is the only other user.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <string>
#include <vector>

#include "commux/communicator.hpp"

namespace commux::detail {

// The UCX memory type of a commux one; UCS_MEMORY_TYPE_LAST where this UCX has none for it.
inline ucs_memory_type_t to_ucs(MemoryType m) noexcept {
  switch (m) {
    case MemoryType::kHost: return UCS_MEMORY_TYPE_HOST;
    case MemoryType::kCuda: return UCS_MEMORY_TYPE_CUDA;
    case MemoryType::kCudaManaged: return UCS_MEMORY_TYPE_CUDA_MANAGED;
    case MemoryType::kRocm: return UCS_MEMORY_TYPE_ROCM;
#if UCP_API_VERSION >= UCP_VERSION(1, 15)  // Intel GPU (Level Zero) memory arrived in UCX 1.15
    case MemoryType::kZe: return UCS_MEMORY_TYPE_ZE_DEVICE;
#else
    case MemoryType::kZe: return UCS_MEMORY_TYPE_LAST;  // unsupported: validate() rejects it
#endif
    case MemoryType::kUnknown: return UCS_MEMORY_TYPE_UNKNOWN;
  }
  return UCS_MEMORY_TYPE_UNKNOWN;
}

// The transports UCX would use in `context`, read from ucp_context_print_info.
std::vector<std::string> query_transports(ucp_context_h context);

class Context {
 public:
  Context() = default;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Reads the UCX configuration, applies commux's defaults (ucx_config.hpp) and creates the
  // context for tag matching, with UCP_FEATURE_WAKEUP when `wakeup`. Fills `info` with what the
  // context offers: UCX version, defaults applied, the user's UCX_* settings, memory types,
  // transports. Throws commux::Error on a UCX failure.
  void create(bool wakeup, std::size_t estimated_eps, RuntimeInfo& info);
  void destroy() noexcept;  // no-op when not created (or destroyed already)
  ucp_context_h handle() const noexcept { return context_; }

 private:
  ucp_context_h context_ = nullptr;
};

}  // namespace commux::detail
