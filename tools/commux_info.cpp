// commux_info: what commux would use in this process -- UCX version, transports, memory types,
// the UCX defaults commux applies, the UCX_* settings found in the environment, and every commux
// setting (commux/settings.hpp) with its value and where it came from.
// Asks UCX through commux::probe_runtime (a one-rank communicator), prints, exits.
#include <cstdio>
#include <cstring>
#include <string>

#include "commux/communicator.hpp"
#include "commux/settings.hpp"

namespace {

void print_list(const char* title, const std::vector<std::string>& items) {
  std::printf("%-22s", title);
  if (items.empty()) std::printf(" (none)");
  for (std::size_t i = 0; i < items.size(); ++i)
    std::printf("%s%s", i ? ", " : " ", items[i].c_str());
  std::printf("\n");
}

}  // namespace

int main() {
  try {
    const commux::Options o = commux::Options::from_env();
    const commux::RuntimeInfo info = commux::probe_runtime(o);
    std::printf("%-22s %s\n", "UCX version", info.ucx_version.c_str());
    print_list("transports", info.transports);
    print_list("memory types", info.memory_types);
    print_list("commux UCX defaults", info.applied_defaults);
    print_list("UCX_* from the env", info.user_settings);
    std::printf("%-22s %s\n", "waiting", info.event_fd ? "worker event fd" : "backoff poll");
    std::printf("%-22s %s\n", "multi-buffer packing",
                o.packing == commux::Packing::kIov ? "IOV (COMMUX_COALESCE)" : "separate parts");
    std::printf("%-22s %lld us\n", "spin before sleeping", static_cast<long long>(o.spin.count()));
    std::printf("%-22s %lld ms\n", "default timeout", static_cast<long long>(o.timeout.count()));
    std::printf("settings (commux/settings.hpp; README \"Runtime settings\"):\n");
    for (const auto& v : commux::settings().values) {
      std::printf("  %-28s %-10s (%s)\n", v.setting->name,
                  v.text.empty()                                ? "-"
                  : std::strcmp(v.setting->type, "secret") == 0 ? "(set)"
                                                                : v.text.c_str(),
                  v.from_env ? "environment" : "default");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "commux_info: %s\n", e.what());
    return 1;
  }
  return 0;
}
