// commux/store.hpp -- the key-value store ranks use to find each other (bootstrap).
//
// Ranks publish their UCX worker address under a key and read their peers'. Any store with
// set / get-with-deadline works: FileStore (a directory every rank can see) ships here for
// torch-free programs and tests; the torch backend adapts c10d::Store to this interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace commux {

class Store {
 public:
  virtual ~Store() = default;
  // Publishes `value` under `key`; readers see either nothing or the whole value.
  virtual void set(const std::string& key, const std::vector<std::uint8_t>& value) = 0;
  // Returns the value of `key`, waiting for it to appear for at most `timeout`.
  // Throws commux::Error(kTimeout) naming the key when it does not appear in time.
  virtual std::vector<std::uint8_t> get(const std::string& key,
                                        std::chrono::milliseconds timeout) = 0;
  // True when `key` exists now (never waits).
  virtual bool check(const std::string& key) = 0;
};

// A store kept in a directory: one file per key, written to a temporary name and renamed, so a
// reader never sees half a value. Works across processes and across network namespaces on one
// host, or on a shared file system. get() polls with a backoff capped at 20 ms.
class FileStore final : public Store {
 public:
  // Creates `dir` (and its parents) if missing.
  explicit FileStore(std::string dir);
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override;
  std::vector<std::uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override;
  bool check(const std::string& key) override;
  const std::string& dir() const { return dir_; }

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

}  // namespace commux

namespace commux {

// A store served over TCP by one rank (the "server", normally rank 0) at host:port; every rank,
// the server included, is a client. For torch-free programs whose ranks share no file system, and
// for the C++ test driver (`test_commux RANK SIZE HOST PORT`). Connecting retries until `timeout`.
// The server keeps serving until its TcpStore is destroyed.
//
// The server listens on `host` only (give "127.0.0.1" for one machine, the interface other hosts
// reach for several; "0.0.0.0" listens on all). It refuses, by closing that connection, a request
// it cannot parse or whose key exceeds kMaxKey / value exceeds kMaxValue bytes (set() refuses them
// first with Errc::kInvalidArgument); a closed connection gives its descriptor and thread back at
// once; running out of descriptors delays accepting, and a listener that fails for good says so on
// stderr. With a token (TcpStoreOptions::token, by default COMMUX_STORE_TOKEN), a client must
// present the server's token before any request: the server closes a connection that does not,
// and that client's constructor throws Errc::kPeerFailed naming the address and the token.
struct TcpStoreOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // connect and per-request deadline
  bool token_from_env = true;  // token = COMMUX_STORE_TOKEN (commux::settings()); else `token`
  std::string token;           // "" = none (a server without one accepts every client)
};

class TcpStore final : public Store {
 public:
  static constexpr std::size_t kMaxKey = 4096;
  static constexpr std::size_t kMaxValue = std::size_t{64} << 20;  // 64 MiB

  TcpStore(const std::string& host, int port, bool is_server,
           std::chrono::milliseconds timeout = std::chrono::seconds(60));
  TcpStore(const std::string& host, int port, bool is_server, const TcpStoreOptions& options);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override;
  std::vector<std::uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override;
  bool check(const std::string& key) override;

 private:
  struct Server;
  std::vector<std::uint8_t> request(std::uint8_t op, const std::string& key,
                                    const std::vector<std::uint8_t>& value, bool* found);
  std::unique_ptr<Server> server_;
  int fd_ = -1;
  std::string where_;
  std::mutex mu_;
};

}  // namespace commux
