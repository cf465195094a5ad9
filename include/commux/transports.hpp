// Which UCX copy transports an accelerator needs, chosen from what the local UCX actually has.
//
// UCX_TLS is an allow list: naming a transport the local UCX lacks narrows the selection instead
// of widening it, and leaving out the accelerator's copy transport silently loses device-memory
// detection (tensors are then read as host memory). So commux never writes an accelerator
// transport into UCX_TLS: it keeps UCX's own selection (all transports, minus commux's deny-list
// defaults) and uses this choice to report what device memory will travel over, and to warn when
// the user's own UCX_TLS leaves the needed copy transport out. The user's UCX_TLS is never changed.
#pragma once

#include <string>
#include <vector>

namespace commux {

enum class Accelerator {
  kNone,     // CPU tensors only
  kCuda,     // NVIDIA CUDA
  kRocm,     // AMD ROCm (torch reports device type "cuda"; torch.version.hip tells it apart)
  kXpu,      // Intel GPUs (Level Zero)
  kUnknown,  // some other device type (named in `TransportChoice::warnings`)
};

const char* accelerator_name(Accelerator a) noexcept;

struct TransportChoice {
  Accelerator accelerator = Accelerator::kNone;
  // The accelerator's transports this UCX has, the copy transport first (e.g. cuda_copy,
  // cuda_ipc, gdr_copy). Never names a transport that is absent.
  std::vector<std::string> transports;
  // The copy transport device memory needs ("cuda_copy", "rocm_copy", "ze_copy"); empty for kNone
  // and kUnknown.
  std::string copy_transport;
  bool copy_available = false;  // the local UCX has copy_transport
  // The user's UCX_TLS allows copy_transport (true when UCX_TLS is unset, or a deny list that does
  // not name it).
  bool copy_allowed = true;
  std::vector<std::string> warnings;  // for the user, one sentence each
};

// `available`: transport names the local UCX has, independent of UCX_TLS (UCX's own names, e.g.
// "rocm_cpy" for rocm_copy). `user_tls`: the UCX_TLS value, nullptr when unset. `other`: the
// device type's name for kUnknown (e.g. "mps"), used in the warning.
TransportChoice choose_transports(Accelerator accelerator,
                                  const std::vector<std::string>& available, const char* user_tls,
                                  const std::string& other = "");

// Transports the local UCX has, whatever UCX_TLS says (starts and closes a UCX context).
std::vector<std::string> ucx_available_transports();

}  // namespace commux
