// What UCX chose between this process and a peer (the lanes of an endpoint), and the debug log's
// INFO lines about the engine and its peers (log.hpp). Private to src/core.
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "commux/communicator.hpp"

namespace commux::detail {

// The endpoint's lanes as "posix/memory (am, am_bw, rma_bw), cma/memory (rma_bw)": transport/device
// and what each lane carries, parsed from ucp_ep_print_info; "" when UCX prints none.
std::string describe_lanes(ucp_ep_h ep);

// Whether `lanes` (describe_lanes) has a shared-memory transport (posix, sysv, xpmem, cma, knem).
bool lanes_use_shared_memory(const std::string& lanes);

// INFO: the UCX version, transports and memory types of this engine (rank `rank` of `size`).
void log_engine_start(int rank, int size, int group, const RuntimeInfo& info);

// INFO: the lanes to `peer`; WARN when a peer on this host is reached without shared memory,
// with the likely reason. Cheap when the log is off (one level check).
void log_peer_lanes(int rank, int peer, int group, bool same_host, ucp_ep_h ep);

}  // namespace commux::detail
