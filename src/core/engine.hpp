// Private to src/core: the UCX engine behind commux::Communicator, composed of one part per UCX
// object, each in its own file:
//
//   context.hpp  Context  the ucp_context: features, memory types, transports (RuntimeInfo)
//   worker.hpp   Worker   the ucp_worker, its mutex, the in-flight list, the progress thread,
//                         the wake and event fds, waiting (spin, then sleep)
//   hub.hpp      Hub      context + worker + progress thread, shared by the Engines of a
//                         process, and the group ids that keep their messages apart
//   peers.hpp    Peers    bootstrap through the Store, one endpoint per peer, peer failure
//   op.hpp       Op       one posted operation; posting and completion are Engine's (op.cpp)
//   engine.cpp            composition: start-up and the shutdown order
//
// Ownership: Engine owns its Peers (the endpoints) and shares its Hub (context, worker, progress
// thread) with the other Engines of the process that could join it; the last one to go releases
// it (endpoints always before the worker, the worker before the context). The Engine's in-flight
// operations sit in the shared worker's in-flight list (an Op owns itself until UCX is done with
// it; Op::engine says whose it is). A Request shares its Op; an Op shares the Engine, so an Engine
// lives until the last Request referring to it is gone, but shutdown() cancels its operations,
// closes its endpoints and frees its group id at the Communicator's destruction regardless.
// Threads: see docs/progress.md. Every field marked [mu], here and in the parts, is guarded by
// the worker mutex (Worker::mutex()).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "channel.hpp"
#include "commux/communicator.hpp"
#include "hub.hpp"
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
  bool spare_cpus() const noexcept override { return spare_cpus_; }
  void hand_back() noexcept override;
  const RuntimeInfo& info() const noexcept override { return info_; }
  Request post(Direction dir, const char* name, const Buffer* buffers, std::size_t count, int peer,
               TagKind kind, std::uint32_t tag, bool fast_completion) override;
  Request post_after(std::shared_ptr<Gate> gate, Direction dir, const char* name,
                     const Buffer* buffers, std::size_t count, int peer, TagKind kind,
                     std::uint32_t tag, bool fast_completion) override;
  bool send_now(const Buffer& buffer, int peer, TagKind kind, std::uint32_t tag) override;
  bool recv_now(const char* name, const Buffer& buffer, int peer, TagKind kind, std::uint32_t tag,
                std::size_t* bytes, Request* posted) override;
  bool probe(TagKind kind, int sender, std::uint32_t value, std::uint32_t mask,
             Unexpected* out) override;
  std::size_t discard(TagKind kind, std::uint32_t value, std::uint32_t mask) override;
  void shutdown() override;
  bool set_driver(std::shared_ptr<Driver> driver) override {
    return worker_.set_driver(this, std::move(driver));
  }
  void wake_driver() noexcept override { worker_.wake_if_asleep(std::chrono::microseconds(100)); }
  std::uint64_t progress_thread_passes() const noexcept override {
    return worker_.progress_thread_passes();
  }
  std::chrono::microseconds progress_thread_nap_left() const noexcept override {
    return worker_.progress_thread_nap_left();
  }
  int sleeping_waiters() const noexcept override { return worker_.sleeping_waiters(); }

  // Requests (op.cpp); Op's RequestState methods call the last three.
  std::shared_ptr<Op> post_op(Op::Kind kind, const char* name, const Buffer* buffers,
                              std::size_t count, int peer, TagKind tag_kind, std::uint32_t tag,
                              bool fast_completion, std::shared_ptr<Gate> gate = nullptr);
  void wait(Op& op, std::chrono::milliseconds timeout);
  bool await(Op& op, std::chrono::milliseconds timeout, bool spin, bool goes_on);
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
  friend class Worker;  // its progress thread and waits drive the steps below

  // Validates the arguments, then agrees on the group id and finds the Hub (hub.hpp).
  static Hub::Placement place(Store* store, int rank, int size, const Options& options);
  // One progress step of the shared worker (Worker::progress_locked): UCX's, then every Engine's.
  unsigned progress_locked() { return worker_.progress_locked(); }
  // This Engine's part of a step, after UCX progressed `n` times: the request work callbacks
  // deferred, then failing what waits on gone peers (receives only when UCX had nothing to do).
  // [mu]
  void step_locked(unsigned n) {
    if (!held_.empty()) release_held_locked();
    if (!deferred_.empty() || !to_cancel_.empty()) run_deferred_locked();
    peers_.reap_locked(n == 0);
  }
  void check_local_peers() { peers_.check_local(); }  // takes the lock itself

  // Requests (op.cpp)
  static void send_cb(void* request, ucs_status_t status, void* user_data);
  static void recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                      void* user_data);
  // The callback of a receive recv_now() posted before it had an Op (user data: the Engine):
  // finds the Part it became (adopted_) and goes on as recv_cb.
  static void adopted_recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                              void* user_data);
  // Registers `op` and gives it to UCX, or holds it back behind `gate` or an earlier held post
  // it must not overtake (post_op's part under the lock, once its checks have passed). [mu]
  void enqueue_locked(const std::shared_ptr<Op>& op, bool fast_completion,
                      std::shared_ptr<Gate> gate);
  // Whether send_now/recv_now may take `b` with `peer` at all (else post() does, and reports
  // what is wrong), and, under the lock, whether nothing forbids it now: a shutdown, a held post
  // it could overtake, a peer that is gone, a broken group for internal traffic.
  bool inside_call_fits(const Buffer& b, int peer) const noexcept;
  bool inside_call_allowed_locked(int peer, TagKind kind) const;  // [mu]
  // A new Op for post_op() or recv_now(), not registered yet.
  std::shared_ptr<Op> make_op(Op::Kind kind, const char* name, const Buffer* buffers,
                              std::size_t count, int peer, TagKind tag_kind, std::uint32_t tag);
  void validate(Op::Kind kind, const char* name, const Buffer* buffers, std::size_t count,
                int peer) const;
  // Gives a registered op to UCX: its first parts (all but an any-source receive's rest).
  void start_locked(const std::shared_ptr<Op>& op);
  void post_locked(const std::shared_ptr<Op>& op, std::size_t first_part, bool fast_completion);
  // Posts the held ops (Op::held) whose turn has come: each whose gate is open and that follows
  // no earlier held op it could overtake in matching (same kind, direction, tag and peer). [mu]
  void release_held_locked();
  bool must_follow_held_locked(const Op& op) const;  // a held op it could overtake waits [mu]
  void post_part_locked(Op& op, std::size_t index, bool fast_completion);
  void part_done_locked(Op& op, std::uint32_t index, ucs_status_t status,
                        const ucp_tag_recv_info_t* info);
  void discard_unexpected_locked(std::chrono::steady_clock::time_point deadline);  // shutdown
  void finish_locked(Op& op);  // with parts still in UCX only for a parked Op
  void unpark_locked(Op& op);  // UCX gave back the last part of a parked Op
  void run_deferred_locked();
  std::string describe(const Op& op) const;
  // The tag and mask that select `kind` messages of this group from any sender, any part, whose
  // user field equals `value` on the bits of `mask`.
  std::pair<std::uint64_t, std::uint64_t> probe_match(TagKind kind, std::uint32_t value,
                                                      std::uint32_t mask) const;
  std::vector<std::shared_ptr<Op>> own_inflight_locked() const;  // this Engine's, in flight [mu]
  // Whether UCX still holds a part of one of this Engine's Ops (with `live`: one whose peer is
  // not gone). [mu]
  bool held_by_ucx_locked(bool live) const;
  void resolve_yield();  // options_.yield: kAuto decided, the worker told (start(), after connect)

  std::shared_ptr<Store> store_;
  const int rank_;
  const int size_;
  Options options_;         // group: the id agreed in place(); read-only after the constructor
  RuntimeInfo info_;        // the Hub's, copied in the constructor, then read-only
  bool spare_cpus_ = true;  // set by resolve_yield(), then read-only (spare_cpus())
  // As many CPUs as ranks on this host: a waiter that goes on keeps the transfers in flight to
  // itself (await()). Set by resolve_yield(), then read-only.
  bool keep_progress_ = false;

  Hub::Placement placement_;  // the shared Hub and this Engine's group id on it
  Worker& worker_;            // placement_.hub's
  Peers peers_{worker_, rank_, size_, this};
  bool shut_down_ = false;  // [mu] set once shutdown() ran: nothing is posted after
  std::vector<std::shared_ptr<Op>> deferred_;   // [mu] any-source ops whose rest must post
  std::vector<std::shared_ptr<Op>> to_cancel_;  // [mu] ops whose other parts must be cancelled
  std::vector<std::shared_ptr<Op>> parked_;     // [mu] failed ops UCX still holds parts of
  std::deque<std::shared_ptr<Op>> held_;        // [mu] posts held back (Op::held), call order
  std::vector<std::unique_ptr<char[]>> unfinished_sinks_;  // [mu] see discard_unexpected_locked
  // [mu] Receives recv_now() posted that UCX kept: its request, and the Part of the Op it became.
  std::vector<std::pair<void*, Part*>> adopted_;
  // [mu] The outcome of the receive recv_now() is making, should UCX complete it through its
  // callback inside the call (UCX 1.13 does for an eager message whose fragments have all
  // arrived, and still returns the request, released by then): nullptr outside that call.
  struct InlineRecv {
    bool done = false;
    ucs_status_t status = UCS_OK;
  };
  InlineRecv* inline_recv_ = nullptr;
};

}  // namespace commux::detail
