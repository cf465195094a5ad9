// TcpStore: a tiny key-value service for bootstrap. The wire format and its parser live in
// store_wire.hpp. One thread per client connection on the server; requests are answered at once (a
// get of a missing key answers "not found" and the client polls with a backoff until its
// deadline). A connection's thread closes its descriptor when the client leaves or sends a frame it
// cannot parse; the acceptor joins finished threads as it goes.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <thread>

#include "commux/error.hpp"
#include "commux/settings.hpp"
#include "commux/store.hpp"
#include "store_wait.hpp"
#include "store_wire.hpp"

namespace commux {

namespace {

using detail::StoreOp;
static_assert(TcpStore::kMaxKey == detail::kStoreMaxKey &&
                  TcpStore::kMaxValue == detail::kStoreMaxValue,
              "TcpStore's documented limits are the wire format's");

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

// A response's value; a length past kStoreMaxValue is not a TcpStore answering.
bool read_blob(int fd, std::vector<std::uint8_t>* out) {
  std::uint32_t len = 0;
  if (!read_all(fd, &len, sizeof(len)) || len > detail::kStoreMaxValue) return false;
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
  struct Conn {
    int fd = -1;  // -1 once its thread has closed it (under mu)
    bool done = false;
    std::thread thread;
  };

  int listen_fd = -1;
  std::string where;
  std::string token;
  std::atomic<bool> stopping{false};
  std::mutex mu;
  std::map<std::string, std::vector<std::uint8_t>> data;
  std::list<Conn> conns;
  std::thread acceptor;

  // Answers one parsed request; false when the connection must close.
  bool answer(int fd, detail::StoreRequest& req, bool* greeted) {
    if (req.op == StoreOp::kHello) {
      if (req.key != token) {
        std::fprintf(stderr,
                     "commux TcpStore: the store at %s closed a connection whose token "
                     "differs from its COMMUX_STORE_TOKEN\n",
                     where.c_str());
        return false;
      }
      *greeted = true;
      const std::uint8_t ok = 1;
      return write_all(fd, &ok, 1);
    }
    if (!*greeted) {
      std::fprintf(stderr,
                   "commux TcpStore: the store at %s closed a connection that sent a "
                   "request without presenting its token\n",
                   where.c_str());
      return false;
    }
    if (req.op == StoreOp::kSet) {
      {
        std::lock_guard<std::mutex> g(mu);
        data[req.key] = std::move(req.value);
      }
      const std::uint8_t ok = 1;
      return write_all(fd, &ok, 1);
    }
    std::vector<std::uint8_t> found_value;
    std::uint8_t found = 0;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = data.find(req.key);
      if (it != data.end()) {
        found = 1;
        if (req.op == StoreOp::kGet) found_value = it->second;
      }
    }
    if (!write_all(fd, &found, 1)) return false;
    return !(found && req.op == StoreOp::kGet) ||
           write_blob(fd, found_value.data(), found_value.size());
  }

  // Reads frames into `buf` and answers each until the client leaves or sends one that cannot
  // parse. The parser rejects a length past the limits from its 4 bytes, so `buf` never holds
  // more than one frame's worth (at most kMaxValue + kMaxKey + 9 bytes) plus one read.
  void serve_frames(int fd) {
    std::vector<std::uint8_t> buf;
    std::vector<std::uint8_t> chunk(64 * 1024);
    bool greeted = token.empty();
    for (;;) {
      detail::StoreRequest req;
      const detail::StoreParse p = detail::parse_store_request(buf.data(), buf.size(), &req);
      if (p.status == detail::StoreParse::kBad) {
        std::fprintf(stderr,
                     "commux TcpStore: the store at %s closed a connection that sent a "
                     "malformed request: %s\n",
                     where.c_str(), p.error.c_str());
        return;
      }
      if (p.status == detail::StoreParse::kDone) {
        buf.erase(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(p.consumed));
        if (!answer(fd, req, &greeted)) return;
        continue;
      }
      const ssize_t r = ::recv(fd, chunk.data(), chunk.size(), 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return;  // the client left (mid-frame or not)
      buf.insert(buf.end(), chunk.begin(), chunk.begin() + r);
    }
  }

  void serve(Conn* c) {
    try {
      serve_frames(c->fd);
    } catch (const std::exception& e) {  // e.g. std::bad_alloc for a large value: this client only
      std::fprintf(stderr, "commux TcpStore: the store at %s dropped a connection: %s\n",
                   where.c_str(), e.what());
    }
    std::lock_guard<std::mutex> g(mu);
    ::close(c->fd);
    c->fd = -1;
    c->done = true;
  }

  // Joins the threads of closed connections (they no longer take `mu` once done is set).
  void reap_locked() {
    for (auto it = conns.begin(); it != conns.end();) {
      if (it->done) {
        it->thread.join();
        it = conns.erase(it);
      } else {
        ++it;
      }
    }
  }

  void accept_loop() {
    bool told_exhausted = false;
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (stopping.load()) {
        if (fd >= 0) ::close(fd);
        return;
      }
      if (fd < 0) {
        const int e = errno;
        if (e == EINTR || e == ECONNABORTED || e == EPROTO) continue;
        if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
          // Out of descriptors or memory: the connection waits in the backlog; retry shortly.
          if (!told_exhausted) {
            std::fprintf(stderr,
                         "commux TcpStore: the store at %s cannot accept a connection "
                         "now (%s); retrying\n",
                         where.c_str(), std::strerror(e));
            told_exhausted = true;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          continue;
        }
        std::fprintf(stderr,
                     "commux TcpStore: the store at %s stopped accepting connections: "
                     "accept failed: %s; clients that connect from now on will time out\n",
                     where.c_str(), std::strerror(e));
        return;
      }
      told_exhausted = false;
      try {
        std::lock_guard<std::mutex> g(mu);
        reap_locked();
        conns.emplace_back();
        Conn* c = &conns.back();
        c->fd = fd;
        try {
          c->thread = std::thread([this, c] { serve(c); });
        } catch (const std::exception&) {
          ::close(fd);
          conns.pop_back();
          throw;
        }
      } catch (const std::exception& e) {  // no thread (or memory) for this client: drop it
        std::fprintf(stderr, "commux TcpStore: the store at %s dropped a connection: %s\n",
                     where.c_str(), e.what());
      }
    }
  }

  ~Server() {
    stopping.store(true);
    ::shutdown(listen_fd, SHUT_RDWR);
    if (acceptor.joinable()) acceptor.join();
    ::close(listen_fd);
    {
      std::lock_guard<std::mutex> g(mu);
      for (Conn& c : conns) {
        if (c.fd >= 0) ::shutdown(c.fd, SHUT_RDWR);
      }
    }
    for (Conn& c : conns) c.thread.join();
  }
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server,
                   std::chrono::milliseconds timeout)
    : TcpStore(host, port, is_server, [&] {
        TcpStoreOptions o;
        o.timeout = timeout;
        return o;
      }()) {}

TcpStore::TcpStore(const std::string& host, int port, bool is_server,
                   const TcpStoreOptions& options)
    : where_(host + ":" + std::to_string(port)) {
  const std::chrono::milliseconds timeout = options.timeout;
  const std::string token = options.token_from_env ? settings().store_token : options.token;
  if (token.size() > kMaxKey) {
    throw Error(Errc::kInvalidArgument, "commux TcpStore: the token for the store at " + where_ +
                                            " is " + std::to_string(token.size()) +
                                            " bytes; at most " + std::to_string(kMaxKey));
  }
  const sockaddr_in addr = resolve(host, port);
  if (is_server) {
    auto s = std::make_unique<Server>();
    s->where = where_;
    s->token = token;
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
  // Present the token (empty when none); a server whose token differs closes the connection.
  const std::vector<std::uint8_t> hello = detail::encode_store_request(StoreOp::kHello, token, {});
  std::uint8_t ok = 0;
  if (!write_all(fd_, hello.data(), hello.size()) || !read_all(fd_, &ok, 1) || ok != 1) {
    ::close(fd_);
    fd_ = -1;
    server_.reset();
    throw Error(Errc::kPeerFailed,
                "commux TcpStore: the store at " + where_ +
                    " refused this client: its token (COMMUX_STORE_TOKEN) differs from this "
                    "process's" +
                    (token.empty() ? " (unset here)" : "") + ", or the store stopped answering");
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

std::vector<std::uint8_t> TcpStore::request(std::uint8_t op, const std::string& key,
                                            const std::vector<std::uint8_t>& value, bool* found) {
  if (key.size() > kMaxKey || value.size() > kMaxValue) {
    throw Error(Errc::kInvalidArgument,
                "commux TcpStore: key '" + key.substr(0, 64) + (key.size() > 64 ? "...'" : "'") +
                    " (" + std::to_string(key.size()) + " bytes, value " +
                    std::to_string(value.size()) + " bytes) exceeds the store's limits: key " +
                    std::to_string(kMaxKey) + " bytes, value " + std::to_string(kMaxValue) +
                    " bytes");
  }
  const std::vector<std::uint8_t> frame =
      detail::encode_store_request(static_cast<StoreOp>(op), key, value);
  std::lock_guard<std::mutex> g(mu_);
  std::uint8_t f = 0;
  std::vector<std::uint8_t> out;
  const bool ok = write_all(fd_, frame.data(), frame.size()) && read_all(fd_, &f, 1) &&
                  (!(f && op == static_cast<std::uint8_t>(StoreOp::kGet)) || read_blob(fd_, &out));
  if (!ok) {
    throw Error(Errc::kPeerFailed, "commux TcpStore: lost the connection to the store at " +
                                       where_ + ", or it stopped answering (key '" + key + "')");
  }
  *found = f != 0;
  return out;
}

void TcpStore::set(const std::string& key, const std::vector<std::uint8_t>& value) {
  bool found = false;
  request(static_cast<std::uint8_t>(StoreOp::kSet), key, value, &found);
}

bool TcpStore::check(const std::string& key) {
  bool found = false;
  request(static_cast<std::uint8_t>(StoreOp::kCheck), key, {}, &found);
  return found;
}

std::vector<std::uint8_t> TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return detail::wait_for_key(key, timeout, "TcpStore", "at " + where_, "(is every rank started?)",
                              [&]() -> std::optional<std::vector<std::uint8_t>> {
                                bool found = false;
                                auto v = request(static_cast<std::uint8_t>(StoreOp::kGet), key, {},
                                                 &found);
                                if (!found) return std::nullopt;
                                return v;
                              });
}

}  // namespace commux
