// The UCX engine: composition of its parts (engine.hpp lists them), start-up, and the shutdown
// order. The threading contract is in docs/progress.md.
#include "engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <set>

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
    });
    return l;
  }();
  return *live;
}

}  // namespace

Engine::Engine(std::shared_ptr<Store> store, int rank, int size, Options options)
    : store_(std::move(store)), rank_(rank), size_(size), options_(std::move(options)) {
  if (!store_) throw Error(Errc::kInvalidArgument, "commux init: no store given");
  if (size_ < 1 || size_ > tag_layout::kMaxRanks) {
    throw Error(Errc::kInvalidArgument, "commux init: world size " + std::to_string(size_) +
                                            " is outside 1.." +
                                            std::to_string(tag_layout::kMaxRanks));
  }
  if (rank_ < 0 || rank_ >= size_) {
    throw Error(Errc::kInvalidArgument, "commux init: rank " + std::to_string(rank_) +
                                            " is outside 0.." + std::to_string(size_ - 1));
  }
  if (options_.group < 0 || options_.group >= tag_layout::kMaxGroups) {
    throw Error(Errc::kInvalidArgument, "commux init: group id " + std::to_string(options_.group) +
                                            " is outside 0.." +
                                            std::to_string(tag_layout::kMaxGroups - 1));
  }
}

Engine::~Engine() {
  {
    LiveEngines& le = live_engines();
    std::lock_guard<std::mutex> lk(le.mu);  // waits while the atexit handler shuts us down
    le.engines.erase(this);
  }
  shutdown();
  // The members go in reverse order: peers_, then worker_ (which closes the wake fd: see
  // worker.hpp), then context_ (already released by shutdown()).
}

void Engine::start() {
  const bool wakeup = options_.wakeup == Options::Wakeup::kOn ||
                      (options_.wakeup == Options::Wakeup::kAuto &&
                       tls_excludes_shared_memory(std::getenv("UCX_TLS")));
  context_.create(wakeup, static_cast<std::size_t>(size_), info_);
  worker_.create(context_.handle(), wakeup, info_);
  peers_.connect(*store_, options_);
  worker_.start_progress_thread();
  {
    LiveEngines& le = live_engines();
    std::lock_guard<std::mutex> lk(le.mu);
    le.engines.insert(this);
  }
}

// ---------------------------------------------------------------------------------------------
// Shutdown: bounded in time whatever the peers do.

void Engine::shutdown() {
  worker_.stop_progress_thread();
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (worker_.shut_down_locked()) return;
  const auto deadline = std::chrono::steady_clock::now() + options_.shutdown_timeout;
  std::vector<std::shared_ptr<Op>> pending = worker_.inflight_snapshot_locked();
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
  if (worker_.handle() != nullptr) {
    if (peers_.any_failed_locked()) discard_unexpected_locked(deadline);
    peers_.close_all_locked(deadline);  // endpoints before their worker
    worker_.destroy_locked();
  }
  parked_.clear();  // UCX (and with it any hold on their parts and on the sinks) is gone
  unfinished_sinks_.clear();
  context_.destroy();  // the context last
  worker_.mark_shut_down_locked();
  pending = worker_.inflight_snapshot_locked();
  for (auto& op : pending) {
    if (op->status == UCS_OK) op->status = UCS_ERR_CANCELED;
    op->remaining = 0;
    finish_locked(*op);
  }
  deferred_.clear();
  // The wake fd stays open until ~Worker, after this: waiting threads kick() it without the lock
  // (worker.hpp says why that is safe only then).
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
