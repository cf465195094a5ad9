// commux_info: what commux would use in this process -- UCX version, transports, memory types,
// the UCX defaults commux applies, and the UCX_* settings found in the environment.
// Starts a one-rank communicator (with a throw-away FileStore) to ask UCX, then exits.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "commux/communicator.hpp"

namespace {

void print_list(const char* title, const std::vector<std::string>& items) {
  std::printf("%-22s", title);
  if (items.empty()) std::printf(" (none)");
  for (std::size_t i = 0; i < items.size(); ++i) std::printf("%s%s", i ? ", " : " ", items[i].c_str());
  std::printf("\n");
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/commux-info-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (dir == nullptr) {
    std::perror("commux_info: mkdtemp");
    return 1;
  }
  int rc = 0;
  try {
    commux::Communicator comm(std::make_shared<commux::FileStore>(dir), 0, 1);
    const commux::RuntimeInfo& info = comm.runtime_info();
    const commux::Options& o = comm.options();
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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "commux_info: %s\n", e.what());
    rc = 1;
  }
  std::filesystem::remove_all(dir);
  return rc;
}
