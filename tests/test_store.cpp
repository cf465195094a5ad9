// TcpStore under hostile or careless clients: malformed frames, lengths past the limits, many
// connections, descriptor exhaustion, a shared secret. Raw sockets speak the wire format
// (src/core/store_wire.hpp) directly; forked children hold the tests that lower process limits.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "commux/error.hpp"
#include "commux/store.hpp"
#include "harness.hpp"

using commux::Errc;
using commux::Error;
using commux::TcpStore;
using commux::test::free_port;

namespace {

using commux::test::kSanitized;

// A raw client: connected, with a 10 s receive timeout so that a server which never answers fails
// the test instead of hanging it. -1 when the connection cannot be made.
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

bool send_bytes(int fd, const std::vector<std::uint8_t>& b) {
  return ::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size());
}

// What the server does next: "eof" (it closed the connection), "timeout" (nothing in 10 s), or
// "data" (it answered).
std::string next_event(int fd) {
  std::uint8_t c = 0;
  const ssize_t r = ::recv(fd, &c, 1, 0);
  if (r == 0) return "eof";
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return "timeout";
  if (r < 0) return std::string("error ") + std::strerror(errno);
  return "data";
}

// A check request (op 3) for `key`, as the wire format has it.
std::vector<std::uint8_t> check_frame(const std::string& key) {
  std::vector<std::uint8_t> f = {3};
  const auto n = static_cast<std::uint32_t>(key.size());
  for (int i = 0; i < 4; ++i) f.push_back(static_cast<std::uint8_t>(n >> (8 * i)));
  f.insert(f.end(), key.begin(), key.end());
  return f;
}

// A well-behaved client still gets answers.
void expect_store_serves(int port, TcpStore& server) {
  TcpStore client("127.0.0.1", port, /*is_server=*/false, std::chrono::seconds(10));
  client.set("after", {7});
  EXPECT_EQ(server.get("after", std::chrono::seconds(10)), (std::vector<std::uint8_t>{7}));
}

int open_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the directory stream's own descriptor
}

// Runs `body` in a forked child (which returns its exit code) and returns "exit N" or
// "signal N"; a child still running after 60 s is killed ("hung").
std::string in_child(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return "hung";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  return "signal " + std::to_string(WTERMSIG(status));
}

long vm_size_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  long kb = 0;
  while (f != nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmSize: %ld kB", &kb) == 1) break;
  }
  if (f != nullptr) std::fclose(f);
  return kb * 1024;
}

}  // namespace

// `01 FF FF FF FF`: a set whose key claims 4 GiB. The server must refuse it from the header alone:
// under an address-space limit of 1 GiB above what the process maps now, allocating the key would
// throw std::bad_alloc in the connection thread and end the process.
TEST(TcpStoreHostile, HugeKeyLengthClosesTheConnectionWithoutAllocating) {
  const std::string r = in_child([] {
    if (!kSanitized) {  // the sanitizers reserve terabytes of shadow address space
      rlimit lim{};
      lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(vm_size_bytes() + (1L << 30));
      if (::setrlimit(RLIMIT_AS, &lim) != 0) return 3;
    }
    const int port = free_port();
    TcpStore server("127.0.0.1", port, /*is_server=*/true, std::chrono::seconds(10));
    const int fd = raw_connect(port);
    if (fd < 0 || !send_bytes(fd, {0x01, 0xFF, 0xFF, 0xFF, 0xFF})) return 4;
    const std::string ev = next_event(fd);
    ::close(fd);
    if (ev != "eof") {
      std::fprintf(stderr, "child: after a 4 GiB key length the server did not close: %s\n",
                   ev.c_str());
      return 5;
    }
    TcpStore client("127.0.0.1", port, /*is_server=*/false, std::chrono::seconds(10));
    client.set("after", {7});
    return server.get("after", std::chrono::seconds(10)) == std::vector<std::uint8_t>{7} ? 0 : 6;
  });
  EXPECT_EQ(r, "exit 0");
}

TEST(TcpStoreHostile, MalformedFramesCloseOnlyThatConnection) {
  const int port = free_port();
  TcpStore server("127.0.0.1", port, /*is_server=*/true, std::chrono::seconds(10));
  struct Case {
    const char* what;
    std::vector<std::uint8_t> bytes;
  };
  const std::vector<Case> cases = {
      {"unknown opcode 9", {0x09, 0x01, 0x00, 0x00, 0x00, 'k'}},
      {"opcode 0", {0x00, 0x00, 0x00, 0x00, 0x00}},
      {"key of 4097 bytes (limit 4096)", {0x03, 0x01, 0x10, 0x00, 0x00}},
      {"value of 64 MiB + 1 (limit 64 MiB)",
       {0x01, 0x01, 0x00, 0x00, 0x00, 'k', 0x01, 0x00, 0x00, 0x04}},
  };
  for (const Case& c : cases) {
    const int fd = raw_connect(port);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_bytes(fd, c.bytes));
    EXPECT_EQ(next_event(fd), "eof") << c.what;
    ::close(fd);
  }
  // Truncated frames: the client gives up halfway; the server sees the end and lets go.
  for (const std::vector<std::uint8_t>& part : std::vector<std::vector<std::uint8_t>>{
           {0x01}, {0x01, 0x05, 0x00}, {0x01, 0x05, 0x00, 0x00, 0x00, 'a', 'b'}}) {
    const int fd = raw_connect(port);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_bytes(fd, part));
    ::shutdown(fd, SHUT_WR);
    EXPECT_EQ(next_event(fd), "eof") << part.size() << " bytes of a frame";
    ::close(fd);
  }
  expect_store_serves(port, server);
}

// Each closed connection gives its descriptor (and thread) back while the server runs.
TEST(TcpStoreHostile, ClosedConnectionsReleaseTheirDescriptors) {
  const int port = free_port();
  TcpStore server("127.0.0.1", port, /*is_server=*/true, std::chrono::seconds(10));
  const int baseline = open_fds();
  for (int i = 0; i < 300; ++i) {
    const int fd = raw_connect(port);
    ASSERT_GE(fd, 0) << "connection " << i;
    ASSERT_TRUE(send_bytes(fd, check_frame("k")));
    ASSERT_EQ(next_event(fd), "data") << "connection " << i;  // the server has accepted it
    ::close(fd);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int now = open_fds();
  while (now > baseline && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    now = open_fds();
  }
  EXPECT_LE(now, baseline) << "descriptors still open 30 s after 300 connections closed";
  expect_store_serves(port, server);
}

// With every descriptor taken, accept() fails (EMFILE); once some are free again the store must
// serve, including the connection that waited in the backlog meanwhile.
TEST(TcpStoreHostile, AcceptorSurvivesRunningOutOfDescriptors) {
  const std::string r = in_child([] {
    const int port = free_port();
    TcpStore server("127.0.0.1", port, /*is_server=*/true, std::chrono::seconds(10));
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = static_cast<rlim_t>(open_fds() + 32);
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) return 3;
    std::vector<int> hog;
    for (int fd; (fd = ::dup(0)) >= 0;) hog.push_back(fd);
    ::close(hog.back());  // room for our own socket only: the server's accept() gets EMFILE
    hog.pop_back();
    const int fd = raw_connect(port);
    if (fd < 0) return 4;
    if (!send_bytes(fd, check_frame("k"))) return 5;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (int h : hog) ::close(h);
    const std::string ev = next_event(fd);
    ::close(fd);
    if (ev != "data") {
      std::fprintf(stderr, "child: after EMFILE the store did not answer: %s\n", ev.c_str());
      return 6;
    }
    TcpStore client("127.0.0.1", port, /*is_server=*/false, std::chrono::seconds(10));
    client.set("after", {7});
    return server.get("after", std::chrono::seconds(10)) == std::vector<std::uint8_t>{7} ? 0 : 7;
  });
  EXPECT_EQ(r, "exit 0");
}

namespace {

commux::TcpStoreOptions with_token(const std::string& token) {
  commux::TcpStoreOptions o;
  o.timeout = std::chrono::seconds(10);
  o.token_from_env = false;
  o.token = token;
  return o;
}

}  // namespace

TEST(TcpStoreToken, ClientsWithTheServersTokenAreServedOthersRefused) {
  const int port = free_port();
  TcpStore server("127.0.0.1", port, /*is_server=*/true, with_token("s3cret"));
  TcpStore good("127.0.0.1", port, /*is_server=*/false, with_token("s3cret"));
  good.set("k", {1});
  EXPECT_EQ(server.get("k", std::chrono::seconds(10)), (std::vector<std::uint8_t>{1}));
  for (const std::string& wrong : {std::string("s3cre"), std::string()}) {
    try {
      TcpStore bad("127.0.0.1", port, /*is_server=*/false, with_token(wrong));
      FAIL() << "a client with token '" << wrong << "' was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kPeerFailed);
      const std::string what = e.what();
      EXPECT_NE(what.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << what;
      EXPECT_NE(what.find("token"), std::string::npos) << what;
    }
  }
  // A raw client that skips the token cannot read or write a key.
  const int fd = raw_connect(port);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(send_bytes(fd, check_frame("k")));
  EXPECT_EQ(next_event(fd), "eof");
  ::close(fd);
  EXPECT_TRUE(good.check("k"));
}

TEST(TcpStoreLimits, OversizedKeyOrValueIsRefusedBeforeSending) {
  const int port = free_port();
  TcpStore server("127.0.0.1", port, /*is_server=*/true, std::chrono::seconds(10));
  try {
    server.set(std::string(TcpStore::kMaxKey + 1, 'k'), {1});
    FAIL() << "a key of kMaxKey + 1 bytes was sent";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("4097 bytes"), std::string::npos) << e.what();
  }
  EXPECT_THROW(server.set("k", std::vector<std::uint8_t>(TcpStore::kMaxValue + 1)), Error);
  // At the limits is fine.
  server.set(std::string(TcpStore::kMaxKey, 'k'), std::vector<std::uint8_t>(1 << 20, 3));
  EXPECT_EQ(server.get(std::string(TcpStore::kMaxKey, 'k'), std::chrono::seconds(10)).size(),
            std::size_t{1} << 20);
  expect_store_serves(port, server);
}
