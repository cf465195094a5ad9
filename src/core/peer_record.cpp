#include "peer_record.hpp"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "commux/error.hpp"

namespace commux::detail {

namespace {

constexpr char kMagic[4] = {'C', 'M', 'X', '1'};

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Field 22 of /proc/<pid>/stat; 0 if the process does not exist or has exited (a zombie).
std::uint64_t start_time_of(std::int32_t pid) {
  const std::string stat = read_first_line("/proc/" + std::to_string(pid) + "/stat");
  const auto paren = stat.rfind(')');  // the command name may contain spaces and parentheses
  if (paren == std::string::npos) return 0;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  constexpr std::uint64_t kExiting = 0x4;  // PF_EXITING: killed or exiting, its sockets closing
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return 0;
    if (i == 9 && (std::stoull(field) & kExiting) != 0) return 0;
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

std::string pid_namespace() {
  char buf[128] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("?");
}

template <typename T>
void put(std::vector<std::uint8_t>& out, const T& v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

}  // namespace

ProcessIdentity self_identity() {
  ProcessIdentity id;
  id.host = read_first_line("/proc/sys/kernel/random/boot_id") + "/" + pid_namespace();
  id.pid = static_cast<std::int32_t>(::getpid());
  id.start_time = start_time_of(id.pid);
  return id;
}

bool process_alive(const ProcessIdentity& id) { return start_time_of(id.pid) == id.start_time; }

std::vector<std::uint8_t> encode_record(const PeerRecord& r) {
  std::vector<std::uint8_t> out(kMagic, kMagic + 4);
  put(out, static_cast<std::uint32_t>(r.identity.host.size()));
  out.insert(out.end(), r.identity.host.begin(), r.identity.host.end());
  put(out, r.identity.pid);
  put(out, r.identity.start_time);
  out.insert(out.end(), r.address.begin(), r.address.end());
  return out;
}

PeerRecord decode_record(const std::vector<std::uint8_t>& bytes, const std::string& who) {
  auto bad = [&] {
    return Error(Errc::kInvalidArgument,
                 "commux init: the store entry of " + who +
                     " is not a commux address record (another program or version in the store?)");
  };
  std::size_t at = 4;
  auto take = [&](void* dst, std::size_t n) {
    if (bytes.size() < at + n) throw bad();
    std::memcpy(dst, bytes.data() + at, n);
    at += n;
  };
  if (bytes.size() < 4 || std::memcmp(bytes.data(), kMagic, 4) != 0) throw bad();
  PeerRecord r;
  std::uint32_t host_len = 0;
  take(&host_len, sizeof(host_len));
  if (bytes.size() < at + host_len) throw bad();
  r.identity.host.assign(reinterpret_cast<const char*>(bytes.data()) + at, host_len);
  at += host_len;
  take(&r.identity.pid, sizeof(r.identity.pid));
  take(&r.identity.start_time, sizeof(r.identity.start_time));
  r.address.assign(bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.end());
  if (r.address.empty()) throw bad();
  return r;
}

}  // namespace commux::detail
