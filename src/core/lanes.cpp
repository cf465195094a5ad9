// Lanes of an endpoint and the debug log's lines about the engine and its peers (lanes.hpp).
#include "lanes.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "log.hpp"

namespace commux::detail {

namespace {

// "8:posix/memory.0" -> "posix/memory"; "rma_bw#0" -> "rma_bw".
std::string strip(std::string w, char lead, char tail) {
  if (lead != '\0') {
    const auto p = w.find(lead);
    if (p != std::string::npos) w = w.substr(p + 1);
  }
  const auto t = w.rfind(tail);
  if (t != std::string::npos && t > 0) w = w.substr(0, t);
  return w;
}

// The lane uses ucp_ep_print_info names after the arrow (the rest is memory domains, segments).
constexpr const char* kUses[] = {"am",  "am_bw", "rma", "rma_bw", "rkey_ptr",
                                 "amo", "tag",   "cm",  "wireup", "keepalive"};

}  // namespace

std::string describe_lanes(ucp_ep_h ep) {
  if (ep == nullptr) return {};
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return {};
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::istringstream in(std::string(buf, len));
  std::free(buf);
  // A lane line:  "#  lane[0]:  8:posix/memory.0 md[4]  -> md[4]/posix/sysdev[255] rma_bw#0 am"
  std::string out, line;
  while (std::getline(in, line)) {
    const auto at = line.find("lane[");
    const auto colon = at == std::string::npos ? at : line.find("]:", at);
    if (colon == std::string::npos) continue;
    std::istringstream words(line.substr(colon + 2));
    std::string w, tl;
    words >> tl;
    if (tl.find('/') == std::string::npos) continue;
    tl = strip(tl, ':', '.');
    std::vector<std::string> uses;
    bool after_arrow = false;
    while (words >> w) {
      if (w == "->") {
        after_arrow = true;
      } else if (after_arrow) {
        w = strip(w, '\0', '#');  // what the lane carries: "am", "rma_bw#0", ...; not md or seg
        for (const char* use : kUses) {
          if (w == use) uses.push_back(w);
        }
      }
    }
    out += out.empty() ? "" : ", ";
    out += tl;
    if (!uses.empty()) {
      out += " (";
      for (std::size_t i = 0; i < uses.size(); ++i) out += (i > 0 ? ", " : "") + uses[i];
      out += ")";
    }
  }
  return out;
}

bool lanes_use_shared_memory(const std::string& lanes) {
  for (const char* t : {"posix/", "sysv/", "xpmem/", "cma/", "knem/"}) {
    if (lanes.find(t) != std::string::npos) return true;
  }
  return false;
}

void log_engine_start(int rank, int size, int group, const RuntimeInfo& info) {
  if (!log::enabled(log::Level::kInfo)) return;
  std::string tls, mem;
  for (const auto& t : info.transports) tls += (tls.empty() ? "" : ", ") + t;
  for (const auto& m : info.memory_types) mem += (mem.empty() ? "" : ", ") + m;
  const char* user_tls = std::getenv("UCX_TLS");
  log::write(log::Level::kInfo, rank,
             log::cat("group ", group, ": rank ", rank, " of ", size, ", UCX ", info.ucx_version,
                      ", transports ", tls.empty() ? "(none)" : tls, ", memory types ",
                      mem.empty() ? "(none)" : mem,
                      user_tls != nullptr && *user_tls != '\0' ? log::cat(", UCX_TLS=", user_tls)
                                                               : std::string()));
}

void log_peer_lanes(int rank, int peer, int group, bool same_host, ucp_ep_h ep) {
  if (!log::enabled(log::Level::kWarn) || peer == rank) return;
  const std::string lanes = describe_lanes(ep);
  COMMUX_LOG(kInfo, rank, "group ", group, ": peer ", peer, same_host ? " (this host)" : "",
             ": lanes ", lanes.empty() ? "(none reported)" : lanes);
  if (same_host && !lanes.empty() && !lanes_use_shared_memory(lanes)) {
    const char* user_tls = std::getenv("UCX_TLS");
    COMMUX_LOG(kWarn, rank, "group ", group, ": peer ", peer,
               " is on this host but UCX reaches it without shared memory (", lanes, "); ",
               user_tls != nullptr && *user_tls != '\0'
                   ? log::cat("UCX_TLS=", user_tls, " leaves shared memory out")
                   : std::string("a UCX without its shared-memory transports, or ranks that "
                                 "do not share /dev/shm (containers), is the usual reason"),
               "; local traffic is then much slower");
  }
}

}  // namespace commux::detail
