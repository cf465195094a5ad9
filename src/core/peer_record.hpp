// Private to src/core: what a rank publishes in the store for its peers -- its UCX worker address
// and who it is on its host, so that peers on the same host can tell whether it is still alive.
//
// Why: UCX's peer error handling (UCP_ERR_HANDLING_MODE_PEER) is not offered by its shared-memory
// transports, so asking for it silently moves same-host peers onto TCP loopback (40-80x slower).
// commux therefore uses peer error handling only towards other hosts, and detects a dead process
// on its own host itself, by its pid and start time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace commux::detail {

struct ProcessIdentity {
  std::string host;  // boot id + pid namespace: equal means "same host, same pid space"
  std::int32_t pid = 0;
  std::uint64_t start_time = 0;  // clock ticks since boot (/proc/<pid>/stat field 22)
};

ProcessIdentity self_identity();
// False once the process is exiting or has exited (or its pid was reused by another process).
bool process_alive(const ProcessIdentity& id);

struct PeerRecord {
  ProcessIdentity identity;
  std::vector<std::uint8_t> address;  // UCX worker address
};

std::vector<std::uint8_t> encode_record(const PeerRecord& r);
// Throws commux::Error(kInvalidArgument) naming `who` on a malformed record.
PeerRecord decode_record(const std::vector<std::uint8_t>& bytes, const std::string& who);

}  // namespace commux::detail
