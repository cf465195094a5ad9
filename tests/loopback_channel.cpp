#include "loopback_channel.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "commux/error.hpp"
#include "world.hpp"

namespace commux::test {

using detail::Direction;

struct LoopbackWorld::Op {
  LoopbackWorld* world = nullptr;
  Direction dir = Direction::kSend;
  const char* name = "";
  int rank = 0;  // the poster
  int peer = 0;  // as posted
  TagKind kind = TagKind::kUser;
  std::uint32_t tag = 0;
  std::vector<Buffer> bufs;
  std::size_t capacity = 0;
  std::vector<char> eager;  // an eager send's copy of its data
  std::atomic<bool> finished{false};
  int sender = -1;
  std::size_t transferred = 0;
  std::exception_ptr error;
  std::string deadlock;  // set when a deadlock is reported while this op is waited for
  bool probing = false;  // waited for by await() (the waiter probes between waits)
  bool woken = false;    // await() returns: let the waiter probe before a deadlock is declared
  std::condition_variable cv;
};

// What a Request refers to.
struct LoopbackWorld::OpState final : detail::RequestState {
  explicit OpState(std::shared_ptr<Op> o) : op(std::move(o)) {}
  bool test() override { return op->finished.load(); }
  void wait_for(std::chrono::milliseconds timeout) override { op->world->wait(*op, timeout); }
  bool await(std::chrono::milliseconds timeout, bool /*spin*/, bool /*goes_on*/) override {
    return op->world->await(*op, timeout);
  }
  void request_cancel() override { op->world->cancel(*op); }
  bool finished() const noexcept override { return op->finished.load(); }
  int posted_peer() const noexcept override { return op->peer; }
  int sender() const noexcept override { return op->sender; }
  std::size_t transferred() const noexcept override { return op->transferred; }
  std::exception_ptr failure() const noexcept override { return op->error; }
  std::chrono::milliseconds default_timeout() const noexcept override {
    return op->world->options_.timeout;
  }
  std::shared_ptr<Op> op;
};

class LoopbackWorld::Chan final : public detail::Channel {
 public:
  Chan(LoopbackWorld* w, int rank) : w_(w), rank_(rank) {}
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return w_->n_; }
  const Options& options() const noexcept override { return w_->options_; }
  const RuntimeInfo& info() const noexcept override { return w_->info_; }

  Request post(Direction dir, const char* name, const Buffer* buffers, std::size_t count, int peer,
               TagKind kind, std::uint32_t tag, bool /*fast_completion*/) override {
    const bool any_ok = dir == Direction::kRecv && peer == kAnySource;
    if (!any_ok && (peer < 0 || peer >= w_->n_)) {
      throw Error(Errc::kInvalidArgument,
                  std::string("commux ") + name + ": peer " + std::to_string(peer) +
                      " is not a rank of a world of " + std::to_string(w_->n_));
    }
    if (count > 0 && buffers == nullptr) {
      throw Error(Errc::kInvalidArgument, std::string("commux ") + name + ": no buffers given");
    }
    auto op = std::make_shared<Op>();
    op->world = w_;
    op->dir = dir;
    op->name = name;
    op->rank = rank_;
    op->peer = peer;
    op->kind = kind;
    op->tag = tag;
    for (std::size_t i = 0; i < count; ++i) {
      if (buffers[i].data == nullptr && buffers[i].size > 0) {
        throw Error(Errc::kInvalidArgument, std::string("commux ") + name + ": buffer " +
                                                std::to_string(i) + " is null with " +
                                                std::to_string(buffers[i].size) + " bytes");
      }
      op->bufs.push_back(buffers[i]);
      op->capacity += buffers[i].size;
    }
    {
      std::lock_guard<std::mutex> g(w_->mu_);
      if (shut_) {
        throw Error(Errc::kCanceled,
                    std::string("commux ") + name + ": the communicator is shut down");
      }
      w_->trace_[static_cast<std::size_t>(rank_)].push_back(
          TraceEvent{TraceEvent::Kind::kPost, dir, peer, kind, tag, op->capacity});
      w_->post_locked(op);
    }
    return detail::make_request(std::make_shared<OpState>(op));
  }

  bool probe(TagKind kind, int sender, std::uint32_t value, std::uint32_t mask,
             detail::Unexpected* out) override {
    std::lock_guard<std::mutex> g(w_->mu_);
    for (const auto& send : w_->queued_[static_cast<std::size_t>(rank_)]) {
      if (send->kind != kind || ((send->tag ^ value) & mask) != 0) continue;
      if (sender >= 0 && send->rank != sender) continue;
      if (out != nullptr) *out = detail::Unexpected{send->rank, send->tag, send->capacity};
      return true;
    }
    return false;
  }

  std::size_t discard(TagKind kind, std::uint32_t value, std::uint32_t mask) override {
    std::lock_guard<std::mutex> g(w_->mu_);
    auto& sends = w_->queued_[static_cast<std::size_t>(rank_)];
    std::size_t n = 0;
    for (auto it = sends.begin(); it != sends.end();) {
      Op& send = **it;
      if (send.kind != kind || ((send.tag ^ value) & mask) != 0) {
        ++it;
        continue;
      }
      if (!send.finished.load()) {  // a rendezvous send: its receiver took it
        send.sender = send.peer;
        send.transferred = send.capacity;
        w_->finish_locked(send, nullptr);
      }
      it = sends.erase(it);
      ++n;
    }
    return n;
  }

  // Cancels what this rank still has posted; what it cancels is reported by unmatched().
  void shutdown() override {
    std::lock_guard<std::mutex> g(w_->mu_);
    if (shut_) return;
    shut_ = true;
    for (auto* lists : {&w_->queued_, &w_->posted_}) {
      for (auto& list : *lists) {
        for (auto it = list.begin(); it != list.end();) {
          Op& op = **it;
          if (op.rank == rank_ && !op.finished.load()) {
            w_->left_at_shutdown_.push_back(describe(op));
            w_->finish_locked(op, std::make_exception_ptr(Error(
                                      Errc::kCanceled, std::string("commux ") + op.name +
                                                           ": the communicator is shut down (" +
                                                           describe(op) + ")")));
            it = list.erase(it);
          } else {
            ++it;
          }
        }
      }
    }
  }

 private:
  LoopbackWorld* w_;
  int rank_;
  bool shut_ = false;  // guarded by the world's mutex
};

LoopbackWorld::LoopbackWorld(int n, LoopMode mode, Options options)
    : n_(n), mode_(mode), options_(std::move(options)) {
  if (n < 1)
    throw Error(Errc::kInvalidArgument, "commux loopback: world size " + std::to_string(n));
  info_.ucx_version = "none (loopback)";
  info_.transports = {"loopback"};
  info_.memory_types = {"host"};
  const auto un = static_cast<std::size_t>(n);
  for (int r = 0; r < n; ++r) chans_.push_back(std::make_shared<Chan>(this, r));
  live_.assign(un, true);
  blocked_.assign(un, nullptr);
  queued_.resize(un);
  posted_.resize(un);
  trace_.resize(un);
}

LoopbackWorld::~LoopbackWorld() = default;

Options LoopbackWorld::default_options() {
  Options o;
  o.timeout = std::chrono::seconds(30);
  o.shutdown_timeout = std::chrono::seconds(1);
  return o;
}

std::shared_ptr<detail::Channel> LoopbackWorld::channel(int rank) {
  return chans_.at(static_cast<std::size_t>(rank));
}

std::unique_ptr<Communicator> LoopbackWorld::communicator(int rank) {
  return detail::communicator_over(channel(rank));
}

void LoopbackWorld::leave(int rank) {
  std::lock_guard<std::mutex> g(mu_);
  live_.at(static_cast<std::size_t>(rank)) = false;
  check_deadlock_locked();
}

std::string LoopbackWorld::describe(const Op& op) {
  std::string s = op.dir == Direction::kSend ? "send to peer " : "recv from ";
  if (op.dir == Direction::kRecv) {
    s += op.peer == kAnySource ? "any source" : "peer " + std::to_string(op.peer);
  } else {
    s += std::to_string(op.peer);
  }
  s += ", tag " + std::to_string(op.tag);
  if (op.kind == TagKind::kInternal) s += " (internal)";
  s += ", " + std::to_string(op.capacity) + " bytes";
  if (op.bufs.size() > 1) s += " in " + std::to_string(op.bufs.size()) + " buffers";
  s += ", rank " + std::to_string(op.rank) + " of " + std::to_string(op.world->n_);
  return s;
}

void LoopbackWorld::post_locked(const std::shared_ptr<Op>& op) {
  ++epoch_;
  auto accepts = [](const Op& recv, const Op& send) {
    return (recv.peer == kAnySource || recv.peer == send.rank) && recv.kind == send.kind &&
           recv.tag == send.tag;
  };
  if (op->dir == Direction::kSend) {
    auto& recvs = posted_[static_cast<std::size_t>(op->peer)];
    for (auto it = recvs.begin(); it != recvs.end(); ++it) {
      if (accepts(**it, *op)) {
        const std::shared_ptr<Op> recv = *it;
        recvs.erase(it);
        deliver_locked(*op, *recv);
        return;
      }
    }
    if (mode_ == LoopMode::kEager) {
      op->eager.resize(op->capacity);
      std::size_t at = 0;
      for (const Buffer& b : op->bufs) {
        if (b.size > 0) std::memcpy(op->eager.data() + at, b.data, b.size);
        at += b.size;
      }
      op->sender = op->peer;
      op->transferred = op->capacity;
      finish_locked(*op, nullptr);
    }
    queued_[static_cast<std::size_t>(op->peer)].push_back(op);
  } else {
    auto& sends = queued_[static_cast<std::size_t>(op->rank)];
    for (auto it = sends.begin(); it != sends.end(); ++it) {
      if (accepts(*op, **it)) {
        const std::shared_ptr<Op> send = *it;
        sends.erase(it);
        deliver_locked(*send, *op);
        return;
      }
    }
    posted_[static_cast<std::size_t>(op->rank)].push_back(op);
  }
}

void LoopbackWorld::deliver_locked(Op& send, Op& recv) {
  // The message as one contiguous run of bytes.
  std::vector<char> gathered;
  const char* data = nullptr;
  if (!send.eager.empty() || send.finished.load()) {
    data = send.eager.data();
  } else if (send.bufs.size() == 1) {
    data = static_cast<const char*>(send.bufs[0].data);
  } else {
    gathered.resize(send.capacity);
    std::size_t at = 0;
    for (const Buffer& b : send.bufs) {
      if (b.size > 0) std::memcpy(gathered.data() + at, b.data, b.size);
      at += b.size;
    }
    data = gathered.data();
  }
  const std::size_t bytes = send.capacity;
  recv.sender = send.rank;
  if (bytes > recv.capacity) {
    finish_locked(
        recv, std::make_exception_ptr(
                  Error(Errc::kTruncated,
                        std::string("commux ") + recv.name + ": message from peer " +
                            std::to_string(send.rank) + " with tag " + std::to_string(send.tag) +
                            " is too long: " + std::to_string(bytes) + " bytes for a receive of " +
                            std::to_string(recv.capacity) + " bytes (" + describe(recv) + ")")));
  } else {
    std::size_t at = 0;
    for (const Buffer& b : recv.bufs) {
      const std::size_t k = std::min(b.size, bytes - at);
      if (k > 0) std::memcpy(b.data, data + at, k);
      at += k;
    }
    recv.transferred = bytes;
    finish_locked(recv, nullptr);
  }
  if (!send.finished.load()) {
    send.sender = send.peer;
    send.transferred = bytes;
    finish_locked(send, nullptr);
  }
}

void LoopbackWorld::finish_locked(Op& op, std::exception_ptr error) {
  ++epoch_;
  op.error = std::move(error);
  op.finished.store(true);
  op.cv.notify_all();
}

void LoopbackWorld::wait(Op& op, std::chrono::milliseconds timeout) {
  if (block(op, timeout, false)) return;
  throw Error(Errc::kTimeout, std::string("commux ") + op.name + ": Timed out after " +
                                  std::to_string(timeout.count()) + " ms (" + describe(op) + ")");
}

bool LoopbackWorld::await(Op& op, std::chrono::milliseconds timeout) {
  return block(op, timeout, true);
}

bool LoopbackWorld::block(Op& op, std::chrono::milliseconds timeout, bool probing) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto ur = static_cast<std::size_t>(op.rank);
  trace_[ur].push_back(
      TraceEvent{TraceEvent::Kind::kWait, op.dir, op.peer, op.kind, op.tag, op.capacity});
  if (op.finished.load()) return true;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  op.deadlock.clear();
  op.probing = probing;
  op.woken = false;
  blocked_[ur] = &op;
  check_deadlock_locked();
  while (!op.finished.load() && op.deadlock.empty() && !op.woken) {
    if (op.cv.wait_until(lk, deadline) == std::cv_status::timeout) break;
  }
  blocked_[ur] = nullptr;
  if (op.finished.load()) return true;
  if (!op.deadlock.empty()) {
    throw Error(Errc::kTimeout, std::string("commux ") + op.name + ": " + op.deadlock);
  }
  return false;
}

void LoopbackWorld::check_deadlock_locked() {
  bool any = false;
  for (int r = 0; r < n_; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (!live_[ur]) continue;
    any = true;
    const Op* op = blocked_[ur];
    if (op == nullptr || op->finished.load() || !op->deadlock.empty() || op->woken) return;
  }
  if (!any) return;
  // Waiters that probe between waits (the collectives' cross-rank call checks) get one chance to
  // look at what is queued for them before this counts as a deadlock: wake them once per state
  // of the world (nothing posted or finished since).
  if (probe_epoch_ != epoch_) {
    bool woke = false;
    for (int r = 0; r < n_; ++r) {
      Op* op = blocked_[static_cast<std::size_t>(r)];
      if (live_[static_cast<std::size_t>(r)] && op->probing) {
        op->woken = true;
        op->cv.notify_all();
        woke = true;
      }
    }
    if (woke) {
      probe_epoch_ = epoch_;
      return;
    }
  }
  std::string msg = "deadlock: every rank waits and nothing can complete:";
  for (int r = 0; r < n_; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (!live_[ur]) continue;
    msg += " rank " + std::to_string(r) + " waits for " + describe(*blocked_[ur]) + ";";
  }
  msg.pop_back();
  ++deadlocks_;
  for (int r = 0; r < n_; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (!live_[ur]) continue;
    blocked_[ur]->deadlock = msg;
    blocked_[ur]->cv.notify_all();
  }
}

void LoopbackWorld::cancel(Op& op) {
  std::lock_guard<std::mutex> g(mu_);
  if (op.finished.load()) return;
  for (auto* lists : {&queued_, &posted_}) {
    for (auto& list : *lists) {
      list.erase(std::remove_if(list.begin(), list.end(),
                                [&](const std::shared_ptr<Op>& p) { return p.get() == &op; }),
                 list.end());
    }
  }
  finish_locked(op, std::make_exception_ptr(Error(Errc::kCanceled, std::string("commux ") +
                                                                       op.name + ": canceled (" +
                                                                       describe(op) + ")")));
}

std::string LoopbackWorld::unmatched() const {
  std::lock_guard<std::mutex> g(mu_);
  std::string s;
  for (const auto& d : left_at_shutdown_) s += "cancelled at shutdown: " + d + "\n";
  for (const auto* lists : {&queued_, &posted_}) {
    for (const auto& list : *lists) {
      for (const auto& op : list) s += "never matched: " + describe(*op) + "\n";
    }
  }
  return s;
}

std::vector<TraceEvent> LoopbackWorld::trace(int rank) const {
  std::lock_guard<std::mutex> g(mu_);
  return trace_.at(static_cast<std::size_t>(rank));
}

int LoopbackWorld::deadlocks() const {
  std::lock_guard<std::mutex> g(mu_);
  return deadlocks_;
}

std::vector<std::string> LoopbackWorld::run(const std::function<void(Communicator&)>& body,
                                            std::chrono::seconds limit) {
  return run_threads(
      n_,
      [&](int r) {
        struct Leave {
          LoopbackWorld* w;
          int r;
          ~Leave() { w->leave(r); }
        } leave{this, r};
        auto comm = communicator(r);
        body(*comm);
      },
      limit);
}

}  // namespace commux::test
