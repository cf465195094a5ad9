// Private to src/core: the UCX settings commux applies by default, and why.
#pragma once

#include <ucp/api/ucp.h>

#include <string>
#include <vector>

namespace commux::detail {

struct UcxDefault {
  const char* name;  // UCX configuration name without the UCX_ prefix
  const char* value;
  const char* why;
  bool (*applies)();  // nullptr: always
};

// True when the CPU reports running under a hypervisor (the "hypervisor" cpuinfo flag).
bool running_under_hypervisor();

// The table of defaults (documented in the README).
const std::vector<UcxDefault>& ucx_defaults();

// Applies each default to `config` unless the user set UCX_<name> in the environment (the user's
// setting always wins) or COMMUX_UCX_DEFAULTS=off. Returns "NAME=value" for each one applied and
// fills `user` with the UCX_* variables found in the environment.
std::vector<std::string> apply_ucx_defaults(ucp_config_t* config, std::vector<std::string>* user);

// True when the UCX_TLS value `tls` (nullptr when unset) lets UCX pick no shared-memory
// transport, so asking for the wakeup feature costs nothing.
bool tls_excludes_shared_memory(const char* tls);

}  // namespace commux::detail
