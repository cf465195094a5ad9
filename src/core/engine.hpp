// Private to src/core: the UCX engine behind commux::Communicator, composed of one part per UCX
// object, each in its own file:
//
//   context.hpp  Context  the ucp_context: features, memory types, transports (RuntimeInfo)
//   worker.hpp   Worker   the ucp_worker, its mutex, the in-flight list, the progress thread,
//                         the wake and event fds, waiting (spin, then sleep)
//   peers.hpp    Peers    bootstrap through the Store, one endpoint per peer, peer failure
//   op.hpp       Op       one posted operation; posting and completion are Engine's (op.cpp)
//   engine.cpp            composition: start-up and the shutdown order
//
// Ownership: Engine owns its Context, Worker and Peers (destroyed in the reverse order: endpoints,
// worker, context), and every in-flight operation through the worker's in-flight list (an Op
// owns itself until UCX is done with it). A Request shares its Op; an Op shares the Engine, so an
// Engine lives until the last Request referring to it is gone, but shutdown() releases all UCX
// resources at the Communicator's destruction regardless.
// Threads: see docs/progress.md. Every field marked [mu], here and in the parts, is guarded by
// the worker mutex (Worker::mutex()).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "channel.hpp"
#include "commux/communicator.hpp"
#include "context.hpp"
#include "op.hpp"
#include "peers.hpp"
#include "worker.hpp"

namespace commux::detail {

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
  Request post(Direction dir, const char* name, const Buffer* buffers, std::size_t count, int peer,
               TagKind kind, std::uint32_t tag, bool fast_completion) override;
  void shutdown() override;

  // Requests (op.cpp); Op's RequestState methods call the last three.
  std::shared_ptr<Op> post_op(Op::Kind kind, const char* name, const Buffer* buffers,
                              std::size_t count, int peer, TagKind tag_kind, std::uint32_t tag,
                              bool fast_completion);
  void wait(Op& op, std::chrono::milliseconds timeout);
  bool test(Op& op);
  void cancel(Op& op);
  // Fails `op` with `code` and `reason` (a peer failure): cancels its UCX requests (a receive UCX
  // has not matched yet then finishes at once) and, unless `linger`, finishes it even if UCX does
  // not give them back, parking the Op until UCX does. With `linger` (the op's own peer is alive,
  // so UCX may still be reading or writing its buffers) an op UCX still holds keeps running and
  // finishes with this error when UCX completes it; Op::lingering_since says since when. Not from
  // inside a UCX callback. [mu]
  void fail_op_locked(Op& op, Errc code, const std::string& reason, bool linger);
  // Gives up waiting for a lingering op: its waits throw its error, it stays posted (Op::abandoned).
  void abandon_locked(Op& op);

 private:
  friend class Worker;  // its progress thread and waits drive the two steps below

  // One progress step: UCX's, then the request work callbacks deferred, then failing what waits
  // on gone peers (receives only when UCX had nothing to do). [mu]
  unsigned progress_locked() {
    if (worker_.handle() == nullptr || worker_.shut_down_locked()) return 0;
    const unsigned n = ucp_worker_progress(worker_.handle());
    if (!deferred_.empty() || !to_cancel_.empty()) run_deferred_locked();
    peers_.reap_locked(n == 0);
    return n;
  }
  void check_local_peers() { peers_.check_local(); }  // takes the lock itself

  // Requests (op.cpp)
  static void send_cb(void* request, ucs_status_t status, void* user_data);
  static void recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                      void* user_data);
  void validate(Op::Kind kind, const char* name, const Buffer* buffers, std::size_t count,
                int peer) const;
  void post_locked(const std::shared_ptr<Op>& op, std::size_t first_part, bool fast_completion);
  void post_part_locked(Op& op, std::size_t index, bool fast_completion);
  void part_done_locked(Op& op, std::uint32_t index, ucs_status_t status,
                        const ucp_tag_recv_info_t* info);
  void discard_unexpected_locked(std::chrono::steady_clock::time_point deadline);  // shutdown
  void finish_locked(Op& op);  // with parts still in UCX only for a parked Op
  void unpark_locked(Op& op);  // UCX gave back the last part of a parked Op
  void run_deferred_locked();
  std::string describe(const Op& op) const;

  std::shared_ptr<Store> store_;
  const int rank_;
  const int size_;
  const Options options_;
  RuntimeInfo info_;  // filled in start(), then read-only

  Context context_;
  Worker worker_{*this};
  Peers peers_{worker_, rank_, size_};
  std::vector<std::shared_ptr<Op>> deferred_;   // [mu] any-source ops whose rest must post
  std::vector<std::shared_ptr<Op>> to_cancel_;  // [mu] ops whose other parts must be cancelled
  std::vector<std::shared_ptr<Op>> parked_;     // [mu] failed ops UCX still holds parts of
  std::vector<std::unique_ptr<char[]>> unfinished_sinks_;  // [mu] see discard_unexpected_locked
};

}  // namespace commux::detail
