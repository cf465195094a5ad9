// Private to src/core: the UCX engine behind commux::Communicator.
//
// Ownership: Engine owns the UCX context, worker and endpoints, and every in-flight operation (the
// `inflight_` map holds a shared_ptr to each Op until UCX is done with it). A Request shares its Op;
// an Op shares the Engine, so an Engine lives until the last Request referring to it is gone, but
// shutdown() releases all UCX resources at the Communicator's destruction regardless.
// Threads: see docs/progress.md. Every field marked [mu] is guarded by worker_mu_.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "channel.hpp"
#include "commux/communicator.hpp"
#include "peer_record.hpp"

namespace commux::detail {

class Engine;

// A vector that keeps its first element inline: the common single-buffer operation then costs no
// allocation besides its Op.
template <typename T>
class SmallVec {
 public:
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T* data() noexcept { return heap_ ? heap_.get() : &inline_; }
  const T* data() const noexcept { return heap_ ? heap_.get() : &inline_; }
  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }
  T* begin() noexcept { return data(); }
  T* end() noexcept { return data() + size_; }
  const T* begin() const noexcept { return data(); }
  const T* end() const noexcept { return data() + size_; }
  void resize(std::size_t n) {  // only on an empty SmallVec
    if (n > 1) heap_.reset(new T[n]());
    size_ = n;
  }

 private:
  T inline_{};
  std::unique_ptr<T[]> heap_;
  std::size_t size_ = 0;
};

struct Part {
  struct Op* op = nullptr;
  std::uint32_t index = 0;
  void* ucx_req = nullptr;          // [mu] in-flight UCX request, or nullptr
  ucp_tag_recv_info_t info{};       // receive info of an immediately completed receive
};

struct Op final : RequestState {
  enum class Kind : std::uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  const char* name = "";            // operation name for messages ("isend", "irecv", ...)
  int peer = 0;                     // requested peer, kAnySource for any-source receives
  TagKind tag_kind = TagKind::kUser;
  std::uint32_t tag = 0;
  Packing packing = Packing::kParts;  // how this op travels (kIov only when > 1 buffer)
  std::size_t capacity = 0;         // total bytes of the posted buffers
  SmallVec<Buffer> buffers;         // the user's buffers (not owned)
  std::vector<ucp_dt_iov_t> iov;    // IOV descriptors, alive until completion
  SmallVec<Part> parts;             // fixed size once posted (pointers into it go to UCX)
  std::shared_ptr<Engine> engine;
  // [mu] While in flight the Op owns itself and sits in the engine's in-flight list.
  std::shared_ptr<Op> self;
  Op* prev = nullptr;
  Op* next = nullptr;

  std::atomic<bool> done{false};
  // Written under the engine's worker_mu_ before `done` is set, read after it is seen set.
  int remaining = 0;                // [mu] UCX messages not yet complete
  ucs_status_t status = UCS_OK;     // [mu] first failure
  Errc override_code = Errc::kTransport;  // [mu] set with has_override for peer failure/shutdown
  bool has_override = false;        // [mu]
  std::string override_reason;      // [mu]
  std::string detail;               // [mu] extra facts for the error message
  int source = -1;                  // [mu] real sender (receives)
  std::size_t bytes = 0;            // [mu] bytes moved
  std::exception_ptr error;         // set once when finished

  // RequestState
  bool test() override;
  void wait_for(std::chrono::milliseconds timeout) override;
  void request_cancel() override;
  bool finished() const noexcept override { return done.load(); }
  int posted_peer() const noexcept override { return peer; }
  int sender() const noexcept override { return source; }
  std::size_t transferred() const noexcept override { return bytes; }
  std::exception_ptr failure() const noexcept override { return error; }
  std::chrono::milliseconds default_timeout() const noexcept override;
};

class Engine final : public Channel, public std::enable_shared_from_this<Engine> {
 public:
  Engine(std::shared_ptr<Store> store, int rank, int size, Options options);
  ~Engine();

  void start();  // bootstrap + progress thread; separate from the constructor (shared_from_this)

  // Channel
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  const Options& options() const noexcept override { return options_; }
  const RuntimeInfo& info() const noexcept override { return info_; }
  Request post(Direction dir, const char* name, const Buffer* buffers, std::size_t count,
               int peer, TagKind kind, std::uint32_t tag, bool fast_completion) override;
  void shutdown() override;

  std::shared_ptr<Op> post_op(Op::Kind kind, const char* name, const Buffer* buffers,
                           std::size_t count, int peer, TagKind tag_kind, std::uint32_t tag,
                           bool fast_completion);
  void wait(Op& op, std::chrono::milliseconds timeout);
  bool test(Op& op);
  void cancel(Op& op);

 private:
  static void send_cb(void* request, ucs_status_t status, void* user_data);
  static void recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                      void* user_data);
  static void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status);

  void validate(Op::Kind kind, const char* name, const Buffer* buffers, std::size_t count,
                int peer) const;
  void post_locked(const std::shared_ptr<Op>& op, std::size_t first_part, bool fast_completion);
  void post_part_locked(Op& op, std::size_t index, bool fast_completion);
  void part_done_locked(Op& op, std::uint32_t index, ucs_status_t status,
                        const ucp_tag_recv_info_t* info);
  void finish_locked(Op& op);
  void fail_peer_locked(int peer, ucs_status_t status, const std::string& reason);
  void check_local_peers();
  void reap_failed_peers_locked();
  unsigned progress_locked();
  void run_deferred_locked();
  void progress_thread_main();
  void kick();
  // Sleeps until kick() (true), `timeout`, or `other_fd` (if >= 0) becomes readable.
  bool wait_for_kick(std::chrono::microseconds timeout, int other_fd);
  std::string describe(const Op& op) const;

  std::shared_ptr<Store> store_;
  const int rank_;
  const int size_;
  const Options options_;
  RuntimeInfo info_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;                       // [mu]
  std::vector<std::pair<Engine*, int>> ep_args_;    // error-callback arguments, one per peer
  std::vector<ucs_status_t> peer_status_;           // [mu] UCS_OK or why the peer failed
  std::vector<std::chrono::steady_clock::time_point> peer_failed_at_;  // [mu]
  std::vector<std::string> peer_reason_;            // [mu] why the peer is gone
  std::vector<ProcessIdentity> peer_identity_;      // set in start(), then read-only
  std::vector<bool> peer_same_host_;                // set in start(), then read-only
  std::vector<void*> closing_;                      // [mu] force-close requests of dead peers
  bool any_peer_failed_ = false;                    // [mu]
  std::chrono::steady_clock::time_point next_reap_{};  // [mu]
  int efd_ = -1;                                    // worker event fd, -1 if none
  bool use_wakeup_ = false;   // event-fd waiting (Options::wakeup, resolved)
  int wake_fd_ = -1;  // eventfd that wakes the progress thread: set in start(), closed in ~Engine

  std::mutex worker_mu_;
  Op* inflight_ = nullptr;                          // [mu] intrusive list of in-flight ops
  void register_locked(const std::shared_ptr<Op>& op);
  std::shared_ptr<Op> unregister_locked(Op& op);
  std::vector<std::shared_ptr<Op>> inflight_snapshot_locked() const;
  std::vector<std::shared_ptr<Op>> deferred_;       // [mu] any-source ops whose rest must post
  std::vector<std::shared_ptr<Op>> to_cancel_;      // [mu] ops whose other parts must be cancelled
  std::atomic<int> inflight_count_{0};
  std::atomic<int> spinners_{0};
  std::atomic<int> sleepers_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;

  std::thread progress_thread_;
  std::atomic<bool> stop_{false};
  bool shut_down_ = false;                          // [mu]
};

}  // namespace commux::detail
