// TcpStore: a tiny key-value service for bootstrap. Wire format, both directions little-endian:
//   request  = op:u8 keylen:u32 key [vallen:u32 value]      op: 1 set, 2 get, 3 check
//   response = found:u8 [vallen:u32 value]                  (value only for a found get)
// One thread per client connection on the server; requests are answered at once (a get of a
// missing key answers "not found" and the client polls with a backoff until its deadline).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "commux/error.hpp"
#include "commux/store.hpp"
#include "store_wait.hpp"

namespace commux {

namespace {

enum : std::uint8_t { kSet = 1, kGet = 2, kCheck = 3 };

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool read_blob(int fd, std::vector<std::uint8_t>* out) {
  std::uint32_t len = 0;
  if (!read_all(fd, &len, sizeof(len))) return false;
  out->resize(len);
  return len == 0 || read_all(fd, out->data(), len);
}

bool write_blob(int fd, const void* data, std::size_t len) {
  const auto n = static_cast<std::uint32_t>(len);
  return write_all(fd, &n, sizeof(n)) && (len == 0 || write_all(fd, data, len));
}

sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    throw Error(Errc::kInvalidArgument, "commux TcpStore: cannot resolve host '" + host + "'");
  }
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  return addr;
}

}  // namespace

struct TcpStore::Server {
  int listen_fd = -1;
  std::mutex mu;
  std::map<std::string, std::vector<std::uint8_t>> data;
  std::vector<int> clients;
  std::vector<std::thread> threads;
  std::thread acceptor;

  void serve(int fd) {
    for (;;) {
      std::uint8_t op = 0;
      std::vector<std::uint8_t> key, value;
      if (!read_all(fd, &op, 1) || !read_blob(fd, &key)) return;
      const std::string k(key.begin(), key.end());
      if (op == kSet) {
        if (!read_blob(fd, &value)) return;
        {
          std::lock_guard<std::mutex> g(mu);
          data[k] = std::move(value);
        }
        const std::uint8_t ok = 1;
        if (!write_all(fd, &ok, 1)) return;
      } else {
        std::vector<std::uint8_t> found_value;
        std::uint8_t found = 0;
        {
          std::lock_guard<std::mutex> g(mu);
          auto it = data.find(k);
          if (it != data.end()) {
            found = 1;
            if (op == kGet) found_value = it->second;
          }
        }
        if (!write_all(fd, &found, 1)) return;
        if (found && op == kGet && !write_blob(fd, found_value.data(), found_value.size())) return;
      }
    }
  }

  void accept_loop() {
    for (;;) {
      const int fd = ::accept(listen_fd, nullptr, nullptr);
      if (fd < 0) {
        if (errno == EINTR) continue;
        return;  // listen socket shut down
      }
      std::lock_guard<std::mutex> g(mu);
      clients.push_back(fd);
      threads.emplace_back([this, fd] { serve(fd); });
    }
  }

  ~Server() {
    ::shutdown(listen_fd, SHUT_RDWR);
    ::close(listen_fd);
    if (acceptor.joinable()) acceptor.join();
    for (int fd : clients) ::shutdown(fd, SHUT_RDWR);
    for (auto& t : threads) t.join();
    for (int fd : clients) ::close(fd);
  }
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server,
                   std::chrono::milliseconds timeout)
    : where_(host + ":" + std::to_string(port)) {
  const sockaddr_in addr = resolve(host, port);
  if (is_server) {
    auto s = std::make_unique<Server>();
    s->listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    ::setsockopt(s->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s->listen_fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(s->listen_fd, 128) != 0) {
      const int e = errno;
      ::close(s->listen_fd);
      throw Error(Errc::kInvalidArgument,
                  "commux TcpStore: cannot listen on " + where_ + ": " + std::strerror(e));
    }
    Server* raw = s.get();
    s->acceptor = std::thread([raw] { raw->accept_loop(); });
    server_ = std::move(s);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) break;
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(Errc::kTimeout, "commux TcpStore: cannot connect to " + where_ + " within " +
                                      std::to_string(timeout.count()) + " ms: " + std::strerror(e) +
                                      " (is rank 0 running?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A store that stops answering fails the request after `timeout` instead of hanging it.
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timeval tv{static_cast<time_t>(secs.count()),
             static_cast<suseconds_t>((timeout - secs).count() * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

std::vector<std::uint8_t> TcpStore::request(std::uint8_t op, const std::string& key,
                                            const std::vector<std::uint8_t>& value, bool* found) {
  std::lock_guard<std::mutex> g(mu_);
  std::uint8_t f = 0;
  std::vector<std::uint8_t> out;
  const bool ok = write_all(fd_, &op, 1) && write_blob(fd_, key.data(), key.size()) &&
                  (op != kSet || write_blob(fd_, value.data(), value.size())) &&
                  read_all(fd_, &f, 1) && (!(f && op == kGet) || read_blob(fd_, &out));
  if (!ok) {
    throw Error(Errc::kPeerFailed, "commux TcpStore: lost the connection to the store at " +
                                       where_ + ", or it stopped answering (key '" + key + "')");
  }
  *found = f != 0;
  return out;
}

void TcpStore::set(const std::string& key, const std::vector<std::uint8_t>& value) {
  bool found = false;
  request(kSet, key, value, &found);
}

bool TcpStore::check(const std::string& key) {
  bool found = false;
  request(kCheck, key, {}, &found);
  return found;
}

std::vector<std::uint8_t> TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return detail::wait_for_key(key, timeout, "TcpStore", "at " + where_, "(is every rank started?)",
                              [&]() -> std::optional<std::vector<std::uint8_t>> {
                                bool found = false;
                                auto v = request(kGet, key, {}, &found);
                                if (!found) return std::nullopt;
                                return v;
                              });
}

}  // namespace commux
