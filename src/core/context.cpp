// The UCX context: its features, and what it tells RuntimeInfo and the transport probe.
#include "context.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "commux/transports.hpp"
#include "status.hpp"
#include "ucx_config.hpp"

namespace commux {

bool RuntimeInfo::supports(MemoryType m) const {
  if (m == MemoryType::kHost || m == MemoryType::kUnknown) return true;
  const ucs_memory_type_t u = detail::to_ucs(m);
  return u != UCS_MEMORY_TYPE_LAST && std::find(memory_types.begin(), memory_types.end(),
                                                ucs_memory_type_names[u]) != memory_types.end();
}

}  // namespace commux

namespace commux::detail {

// The transports are the "... flags -- tl/dev" lines of ucp_context_print_info.
std::vector<std::string> query_transports(ucp_context_h context) {
  std::vector<std::string> out;
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return out;
  ucp_context_print_info(context, f);
  std::fclose(f);
  std::istringstream in(std::string(buf, len));
  std::free(buf);
  std::set<std::string> seen;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("resource") == std::string::npos) continue;
    const auto slash = line.rfind('/');
    const auto space = line.rfind(' ', slash);
    if (slash == std::string::npos || space == std::string::npos) continue;
    std::string tl = line.substr(space + 1, slash - space - 1);
    if (!tl.empty() && seen.insert(tl).second) out.push_back(tl);
  }
  return out;
}

void Context::create(bool wakeup, std::size_t estimated_eps, RuntimeInfo& info) {
  ucp_config_t* config = nullptr;
  check_status(ucp_config_read(nullptr, nullptr, &config), "init: reading the UCX configuration");
  info.applied_defaults = apply_ucx_defaults(config, &info.user_settings);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG;
  // UCP_FEATURE_WAKEUP keeps shared memory (its FIFOs signal an armed receiver). Asked for when
  // forced, or by default only where it measured no slower (Options::wakeup, docs/progress.md).
  if (wakeup) params.features |= UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.estimated_num_eps = estimated_eps;
  const ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check_status(st, "init: ucp_init");

  info.ucx_version = ucp_get_version_string();
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  check_status(ucp_context_query(context_, &attr), "init: ucp_context_query");
  for (int m = 0; m < UCS_MEMORY_TYPE_LAST; ++m) {
    if (attr.memory_types & (std::uint64_t{1} << m)) {
      info.memory_types.emplace_back(ucs_memory_type_names[m]);
    }
  }
  info.transports = query_transports(context_);
}

void Context::destroy() noexcept {
  if (context_ == nullptr) return;
  ucp_cleanup(context_);
  context_ = nullptr;
}

}  // namespace commux::detail

namespace commux {

std::vector<std::string> ucx_available_transports() {
  ucp_config_t* config = nullptr;
  detail::check_status(ucp_config_read(nullptr, nullptr, &config),
                       "transport probe: reading the UCX configuration");
  // Every transport, whatever UCX_TLS says: the question is what this UCX has.
  ucp_config_modify(config, "TLS", "all");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h context = nullptr;
  const ucs_status_t st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  detail::check_status(st, "transport probe: ucp_init");
  std::vector<std::string> out = detail::query_transports(context);
  ucp_cleanup(context);
  return out;
}

}  // namespace commux
