// The UCX engine: composition of its parts (engine.hpp lists them), start-up, and the shutdown
// order. The threading contract is in docs/progress.md.
#include "engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <set>

#include <sched.h>
#include <unistd.h>

#include "lanes.hpp"
#include "log.hpp"
#include "ucx_config.hpp"

namespace commux::detail {

namespace {

// Engines still running when the process exits (a program, or Python, that never shut its
// communicators down) are shut down by an atexit handler. It is registered after UCX's libraries
// were loaded and initialised, so it runs before their destructors: without it the progress thread
// can be inside ucp_worker_progress while UCX tears itself down, and the exit crashes.
struct LiveEngines {
  std::mutex mu;
  std::set<Engine*> engines;
};

LiveEngines& live_engines() {
  static LiveEngines* live = [] {
    auto* l = new LiveEngines();  // never destroyed: the atexit handler may run after statics go
    std::atexit([] {
      LiveEngines& le = live_engines();
      std::lock_guard<std::mutex> lk(le.mu);
      for (Engine* e : le.engines) e->shutdown();
      le.engines.clear();
      Hub::shutdown_all();  // then the shared workers and their progress threads
    });
    return l;
  }();
  return *live;
}

// The CPUs this process may run on (its affinity mask).
int usable_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

}  // namespace

Hub::Placement Engine::place(Store* store, int rank, int size, const Options& options) {
  if (store == nullptr) throw Error(Errc::kInvalidArgument, "commux init: no store given");
  if (size < 1 || size > tag_layout::kMaxRanks) {
    throw Error(Errc::kInvalidArgument, "commux init: world size " + std::to_string(size) +
                                            " is outside 1.." +
                                            std::to_string(tag_layout::kMaxRanks));
  }
  if (rank < 0 || rank >= size) {
    throw Error(Errc::kInvalidArgument, "commux init: rank " + std::to_string(rank) +
                                            " is outside 0.." + std::to_string(size - 1));
  }
  if (options.group < 0 || options.group >= tag_layout::kMaxGroups) {
    throw Error(Errc::kInvalidArgument, "commux init: group id " + std::to_string(options.group) +
                                            " is outside 0.." +
                                            std::to_string(tag_layout::kMaxGroups - 1));
  }
  const bool wakeup = options.wakeup == Options::Wakeup::kOn ||
                      (options.wakeup == Options::Wakeup::kAuto &&
                       tls_excludes_shared_memory(std::getenv("UCX_TLS")));
  return Hub::join(*store, rank, size, options, wakeup);
}

Engine::Engine(std::shared_ptr<Store> store, int rank, int size, Options options)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(std::move(options)),
      placement_(place(store_.get(), rank_, size_, options_)),
      worker_(placement_.hub->worker()) {
  options_.group = placement_.group;
  info_ = placement_.hub->info();
}

Engine::~Engine() {
  {
    LiveEngines& le = live_engines();
    std::lock_guard<std::mutex> lk(le.mu);  // waits while the atexit handler shuts us down
    le.engines.erase(this);
  }
  shutdown();
  // Then peers_ (closed already) and the Hub: the last Engine on it stops its progress thread
  // and releases the worker and the context (hub.cpp).
}

void Engine::start() {
  try {
    peers_.connect(*store_, options_);
  } catch (...) {
    shutdown();  // closes what was connected, frees the group id
    throw;
  }
  resolve_yield();
  log_engine_start(rank_, size_, options_.group, info_);
  worker_.attach(this);
  {
    LiveEngines& le = live_engines();
    std::lock_guard<std::mutex> lk(le.mu);
    le.engines.insert(this);
  }
}

// Yield mode (Options::yield): kAuto becomes kOn when this group's ranks on this host (connect()
// found which peers share it) outnumber the CPUs this process may run on; otherwise it leaves the
// worker's mode as it is (yield after a short spin, unless another communicator said otherwise).
void Engine::resolve_yield() {
  int local = 1;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].same_host) ++local;
  }
  const int cpus = usable_cpus();
  spare_cpus_ = cpus > local;
  keep_progress_ = cpus == local;
  if (options_.yield == Options::Yield::kAuto && local > cpus) options_.yield = Options::Yield::kOn;
  if (options_.yield == Options::Yield::kOff) worker_.set_yield_mode(Worker::YieldMode::kNever);
  if (options_.yield == Options::Yield::kOn) {
    worker_.set_yield_mode(Worker::YieldMode::kAlways);
    COMMUX_LOG(kInfo, rank_, "group ", options_.group, ": ", local, " of its ranks on this host, ",
               cpus, " CPUs for this process: waiters yield the CPU (COMMUX_YIELD)");
  }
}

// ---------------------------------------------------------------------------------------------
// Shutdown: bounded in time whatever the peers do.

void Engine::shutdown() {
  // Only this Engine's operations and endpoints: the worker, its progress thread and the other
  // Engines' operations go on (docs/progress.md, "One worker per process").
  worker_.detach(this);  // no progress step or peer check calls into this Engine after this
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(worker_.mutex());
    if (shut_down_) return;
    shut_down_ = true;
    const auto deadline = std::chrono::steady_clock::now() + options_.shutdown_timeout;
    std::vector<std::shared_ptr<Op>> pending = own_inflight_locked();
    for (auto& op : pending) {
      if (!op->has_override) {
        op->has_override = true;
        op->override_code = Errc::kCanceled;
        op->override_reason = "the communicator was shut down while the operation was in flight";
      }
      if (op->kind == Op::Kind::kRecv && worker_.handle() != nullptr) {
        op->cancel_parts_locked(worker_.handle());
      }
    }
    failed = worker_.handle() != nullptr && peers_.any_failed_locked();
    if (worker_.handle() != nullptr) {
      if (failed) discard_unexpected_locked(deadline);  // the dead peers' messages
      peers_.close_all_locked(deadline);  // flushes (or force-closes) what is still queued
      run_deferred_locked();
      // What UCX still holds a part of (a receive that matched before its cancel, whose last
      // fragments are on their way; a send still queued) writes into or reads from its owner's
      // buffer until UCX completes it, and the worker outlives this Engine (the process's other
      // communicators share it): it is progressed to its end, within the shutdown timeout, before
      // its wait may return and its owner free the buffer. A gone peer's is not waited for.
      while (std::chrono::steady_clock::now() < deadline && held_by_ucx_locked(/*live=*/true)) {
        if (worker_.progress_locked() == 0) ::usleep(50);
      }
      // Messages to this group that nothing received: a later communicator may get its id. After
      // a peer failure only the dead peers' are received (above): receiving a live peer's
      // rendezvous would restart its abandoned send, whose buffer its owner may have freed; the
      // group id is then kept (below), so no later communicator can match what is left.
      if (!failed) {
        worker_.drop_unexpected_locked(
            std::uint64_t(options_.group) << tag_layout::kGroupShift, tag_layout::kGroupMask,
            std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
      }
    }
    pending = own_inflight_locked();
    for (auto& op : pending) {
      // Still inside UCX after the shutdown timeout: UCX may yet call back into the Op, so its
      // memory stays valid to the end of the process (hub.hpp).
      const bool in_ucx = std::any_of(op->parts.begin(), op->parts.end(),
                                      [](const Part& p) { return p.ucx_req != nullptr; });
      if (in_ucx && worker_.handle() != nullptr) {
        placement_.hub->keep_forever_locked(op);
        op->override_reason +=
            "; UCX still held its buffer when the shutdown timeout ended and may yet " +
            std::string(op->kind == Op::Kind::kRecv ? "write into" : "read from") +
            " it: keep the buffer alive to the end of the process";
      }
      if (op->status == UCS_OK) op->status = UCS_ERR_CANCELED;
      op->remaining = 0;
      finish_locked(*op);
    }
    // Failed ops UCX still holds parts of, and the sinks of dead peers' messages still being
    // received: the shared worker lives on and may still write into them.
    for (auto& op : parked_) {
      if (worker_.handle() != nullptr) placement_.hub->keep_forever_locked(op);
    }
    parked_.clear();
    for (auto& sink : unfinished_sinks_) static_cast<void>(sink.release());
    unfinished_sinks_.clear();
    deferred_.clear();
    to_cancel_.clear();
    worker_.held_changed(-static_cast<int>(held_.size()));  // finished above, never posted
    held_.clear();
  }
  if (!failed) placement_.hub->release(placement_.group);
  // The wake fd stays open until the Hub goes, after this: waiting threads kick() it without the
  // lock (worker.hpp says why that is safe only then).
}

bool Engine::held_by_ucx_locked(bool live) const {
  for (Op* op = worker_.inflight_locked(); op != nullptr; op = op->next) {
    if (op->engine.get() != this) continue;
    const int with = op->peer != kAnySource ? op->peer : op->source;
    if (live && with >= 0 && with < size_ && peers_[with].status != UCS_OK) continue;
    for (const Part& p : op->parts) {
      if (p.ucx_req != nullptr) return true;
    }
  }
  return false;
}

std::vector<std::shared_ptr<Op>> Engine::own_inflight_locked() const {
  std::vector<std::shared_ptr<Op>> out;
  for (Op* op = worker_.inflight_locked(); op != nullptr; op = op->next) {
    if (op->engine.get() == this) out.push_back(op->self);
  }
  return out;
}

// After a peer failure, messages from the dead peer are left that nobody will receive. Receiving
// them into sinks spares UCX's warnings about unmatched messages when the worker is destroyed.
// Only the dead peers' messages: receiving a live peer's rendezvous would restart its send of a
// buffer its owner may have freed since the collective failed.
void Engine::discard_unexpected_locked(std::chrono::steady_clock::time_point deadline) {
  // One sink per message: UCX writes a rendezvous message's data while later ones are probed.
  std::vector<std::unique_ptr<char[]>> sinks;
  std::vector<void*> pending;
  using namespace tag_layout;
  for (int p = 0, i = 0; p < size_ && i < 100000; ++p) {
    if (p == rank_ || peers_[p].status == UCS_OK) continue;
    const ucp_tag_t from = (static_cast<ucp_tag_t>(p) << kRankShift) |
                           (static_cast<ucp_tag_t>(options_.group) << kGroupShift);
    for (; i < 100000 && std::chrono::steady_clock::now() < deadline; ++i) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h msg =
          ucp_tag_probe_nb(worker_.handle(), from, kRankMask | kGroupMask, 1, &info);
      if (msg == nullptr) {
        if (ucp_worker_progress(worker_.handle()) == 0) break;
        continue;
      }
      sinks.emplace_back(new char[std::max<std::size_t>(info.length, 1)]);
      ucp_request_param_t prm{};
      void* r = ucp_tag_msg_recv_nbx(worker_.handle(), sinks.back().get(), info.length, msg, &prm);
      if (UCS_PTR_IS_PTR(r)) pending.push_back(r);
    }
  }
  if (!complete_requests_locked(worker_.handle(), pending, deadline)) {
    // Still being received at the deadline: UCX may write into the sinks until the worker goes.
    unfinished_sinks_ = std::move(sinks);
  }
}

}  // namespace commux::detail
