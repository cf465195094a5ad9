#include "exchange.hpp"

#include "../core/channel.hpp"
#include "schedule.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

namespace commux::coll::detail {

namespace {

// How long a failing collective waits for its cancelled requests, all together.
constexpr std::chrono::milliseconds kCancelBound{1000};
// A wait checks for another rank's different call after this long, then this often.
constexpr std::chrono::milliseconds kFirstCheck = kSpinningWait;
constexpr std::chrono::milliseconds kCheckEvery{10};

// Requests that did not finish even after cancel(), with the scratch they may still touch and
// what callers handed over for them (hold_while_posted). Kept until they complete; checked
// whenever a collective starts. Never destroyed (no work at exit).
struct Parked {
  const Communicator* comm = nullptr;  // the call's (nullptr: a notice's send)
  std::uint32_t tag = 0;
  std::vector<Request> reqs;
  std::vector<std::unique_ptr<char[]>> scratch;
  std::vector<std::shared_ptr<const void>> held;

  bool finished() const {
    return std::all_of(reqs.begin(), reqs.end(), [](const Request& r) { return r.done(); });
  }
};

// The process's cache of scratch buffers: at most kPoolBytes in all, none larger than that. One
// for the process, not per thread: a schedule takes its scratch on the thread that starts it and
// gives it back on the one that finishes it, and per-thread caches then left the starting
// thread's empty (fresh, page-faulting memory for every call, 2x the time of a 256 KiB
// all_reduce a pool thread finished).
constexpr std::size_t kPoolBytes = std::size_t{64} << 20;

// Small scratch (a reduce of a few elements takes one buffer per call) comes from slots of
// kSmallBytes taken and given back with one atomic exchange each, without the pool's lock.
constexpr std::size_t kSmallBytes = 4096;
constexpr std::size_t kSmallSlots = 16;

struct Pool {
  std::atomic<char*> small[kSmallSlots] = {};  // free kSmallBytes buffers, or nullptr

  char* take_small() noexcept {
    for (auto& slot : small) {
      if (slot.load(std::memory_order_relaxed) == nullptr) continue;
      char* p = slot.exchange(nullptr, std::memory_order_acquire);
      if (p != nullptr) return p;
    }
    return nullptr;
  }
  // Keeps `p` (kSmallBytes) in a free slot; false when every slot is full.
  bool give_small(char* p) noexcept {
    for (auto& slot : small) {
      char* expected = nullptr;
      if (slot.load(std::memory_order_relaxed) == nullptr &&
          slot.compare_exchange_strong(expected, p, std::memory_order_release)) {
        return true;
      }
    }
    return false;
  }

  std::mutex mu;                                                      // guards everything below
  std::vector<std::pair<std::size_t, std::unique_ptr<char[]>>> bufs;  // (size, memory)
  std::size_t total = 0;

  // The smallest cached buffer of at least `bytes`, or none (nullptr).
  std::pair<std::size_t, std::unique_ptr<char[]>> take(std::size_t bytes) {
    std::size_t best = bufs.size();
    for (std::size_t i = 0; i < bufs.size(); ++i) {
      if (bufs[i].first >= bytes && (best == bufs.size() || bufs[i].first < bufs[best].first))
        best = i;
    }
    if (best == bufs.size()) return {bytes, nullptr};
    auto b = std::move(bufs[best]);
    bufs.erase(bufs.begin() + static_cast<std::ptrdiff_t>(best));
    total -= b.first;
    return b;
  }

  // Keeps the buffer if it fits, evicting the smallest cached ones to make room.
  void give(std::size_t size, std::unique_ptr<char[]> data) {
    if (size > kPoolBytes || size == 0) return;
    std::sort(bufs.begin(), bufs.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    while (total + size > kPoolBytes && !bufs.empty()) {
      total -= bufs.front().first;
      bufs.erase(bufs.begin());
    }
    bufs.emplace_back(size, std::move(data));
    total += size;
  }
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: collectives may end during exit
  return *p;
}

struct ParkingLot {
  std::mutex mu;
  std::vector<Parked> lots;
  // = !lots.empty() (written under mu): a collective's start reads it without the lock; one that
  // misses a request parked at that moment reaps it at the next start.
  std::atomic<bool> any{false};
};

ParkingLot& parking() {
  static ParkingLot* lot = new ParkingLot;  // intentionally leaked
  return *lot;
}

void reap_parked() {
  ParkingLot& p = parking();
  if (!p.any.load(std::memory_order_acquire)) return;
  std::vector<Parked> done;  // freed after the lock is let go: a held owner may be a tensor
  {
    std::lock_guard<std::mutex> g(p.mu);
    const auto first = std::stable_partition(p.lots.begin(), p.lots.end(),
                                             [](const Parked& x) { return !x.finished(); });
    done.assign(std::make_move_iterator(first), std::make_move_iterator(p.lots.end()));
    p.lots.erase(first, p.lots.end());
    p.any.store(!p.lots.empty(), std::memory_order_release);
  }
}

}  // namespace

void park(Request request, std::unique_ptr<char[]> data) {
  if (request.done()) return;
  ParkingLot& p = parking();
  std::lock_guard<std::mutex> g(p.mu);
  p.lots.emplace_back();
  p.any.store(true, std::memory_order_release);
  p.lots.back().reqs.push_back(std::move(request));
  p.lots.back().scratch.push_back(std::move(data));
}

namespace {

const char* op_or_default(const char* op) {
  return op != nullptr && *op != '\0' ? op : "collective";
}

}  // namespace

Exchange::Exchange(const Context& ctx) : ctx_(ctx) {
  ctx_.op_name = op_or_default(ctx.op_name);
  // Inside a Schedule the caller's text may not outlive the call's first wait (its caller goes
  // on): copied. A blocking call's caller holds it until the call returns (copying it was a tenth
  // of an 8-byte allreduce's instructions on one rank).
  if (ctx.call_text != nullptr && current_schedule() != nullptr) {
    call_text_ = ctx.call_text;
    ctx_.call_text = call_text_.c_str();
  }
  if (ctx.comm == nullptr) invalid(ctx_, "Context::comm is null");
  chan_ = &::commux::detail::channel(*ctx.comm);
  rank_ = chan_->rank();
  size_ = chan_->size();
  // Without a deadline of the caller's, the communicator's timeout counts from the first wait that
  // has to wait (deadline()): a call whose messages all complete at their posts reads no clock.
  if (ctx.deadline != Clock::time_point::max()) deadline_ = ctx.deadline;
  wire_ = call_wire_tag(ctx_.tag, 0);  // until identify()
  reqs_.reserve(kInlineRequests);      // in room_
  reap_parked();
  if (ctx_.device != nullptr) ctx_.device->synchronize();  // the caller's device work on inputs
}

Exchange::~Exchange() {
  abort();
  if (handed_) chan_->hand_back();
  for (auto& sc : scratch_) {
    if (sc.device != nullptr) {
      ctx_.device->release(sc.device);
    } else if (sc.size == kSmallBytes) {
      if (pool().give_small(sc.data.get())) static_cast<void>(sc.data.release());
    } else {
      Pool& p = pool();
      std::lock_guard<std::mutex> g(p.mu);
      p.give(sc.size, std::move(sc.data));
    }
  }
}

void Exchange::invalid(const Context& ctx, const std::string& what) {
  reject(ctx, what);  // the other ranks' matching call fails at once instead of waiting
  throw Error(Errc::kInvalidArgument, ErrorSite{op_or_default(ctx.op_name), {}, {}, {}, {}}, what);
}

Clock::time_point Exchange::deadline(Clock::time_point now) {
  if (deadline_ == Clock::time_point::max()) deadline_ = now + chan_->options().timeout;
  return deadline_;
}

std::chrono::milliseconds Exchange::remaining(Clock::time_point now) {
  const auto left = deadline(now) - now;
  if (left <= Clock::duration::zero()) return std::chrono::milliseconds(0);
  return std::chrono::ceil<std::chrono::milliseconds>(left);
}

std::size_t Exchange::send(const void* data, std::size_t bytes, int peer, MemoryType mem) {
  const Buffer b{const_cast<void*>(data), bytes, mem};
  try {
    // A small message the transport takes inside the call is complete: no request to wait for.
    if (chan_->send_now(b, peer, TagKind::kInternal, wire_)) return done_inside_call(bytes);
    // Fast completion: the collectives wait for their sends at once; UCX applies it only to
    // messages below its eager threshold, large ones stay zero-copy rendezvous.
    reqs_.push_back(Posted{chan_->post_send(&b, 1, peer, TagKind::kInternal, wire_, true)});
  } catch (const Error& e) {
    rethrow(e);
  }
  return reqs_.size() - 1;
}

std::size_t Exchange::recv(void* data, std::size_t bytes, int peer, MemoryType mem) {
  const Buffer b{data, bytes, mem};
  try {
    // A message that is there already is received inside the call: no request to wait for.
    std::size_t got = 0;
    Request posted;
    if (chan_->recv_now("recv", b, peer, TagKind::kInternal, wire_, &got, &posted)) {
      return done_inside_call(got);
    }
    if (posted.valid()) {
      reqs_.push_back(Posted{std::move(posted)});
      return reqs_.size() - 1;
    }
    reqs_.push_back(Posted{chan_->post_recv(&b, 1, peer, TagKind::kInternal, wire_)});
  } catch (const Error& e) {
    rethrow(e);
  }
  return reqs_.size() - 1;
}

void Exchange::wait(std::size_t id) {
  // Wait in slices; between them, look for signs that another rank is in a different call (a
  // notice, or a message with this call's tag slot but another fingerprint). The first slice spins
  // as a plain wait does, so a collective that completes in time costs nothing more.
  // (At most one clock read on the way, as a plain wait: small collectives pay nothing
  // measurable.)
  if (reqs_[id].waited) return;  // waited for already, or moved inside its call
  ::commux::detail::RequestState* st = ::commux::detail::state_of(reqs_[id].req);
  try {
    // Inside a Schedule: suspend instead of blocking, until the request finishes or the deadline
    // passes (the blocking wait below then only reports it), making the same checks meanwhile.
    if (st != nullptr && !st->finished()) {
      Schedule::Impl* s = current_schedule();
      if (s != nullptr && !blocking(s)) suspend_for(s, id);
    }
    // Finished already (a small message found at the post): no clock read, wait() only reports.
    auto left = std::chrono::milliseconds(0);
    if (st == nullptr || !st->finished()) {
      const auto now = Clock::now();
      began_waiting(now);
      left = remaining(now);
    }
    if (st != nullptr && left > kFirstCheck) {
      // (The call goes on after this wait: its end hands the other transfers in flight back,
      // ~Exchange.)
      handed_ = true;
      for (bool first = true;; first = false) {
        if (st->await(first ? kFirstCheck : kCheckEvery, first, /*goes_on=*/true)) {
          left = std::chrono::milliseconds(0);  // finished: wait() below only reports it
          break;
        }
        check_calls(id);
        if (ctx_.poll != nullptr) poll_caller();
        left = remaining();
        if (left <= kCheckEvery) break;
      }
    }
    reqs_[id].req.wait(left);
  } catch (const Error& e) {
    if (e.code() == Errc::kCallMismatch) throw;  // check_calls has cleaned up and described it
    rethrow(e);
  }
  // Requests before first_open_ are complete and were waited for (their errors seen).
  reqs_[id].waited = true;
  while (first_open_ < reqs_.size() && reqs_[first_open_].waited) ++first_open_;
}

void Exchange::suspend_for(Schedule::Impl* s, std::size_t id) {
  ::commux::detail::RequestState* st = ::commux::detail::state_of(reqs_[id].req);
  const auto since = Clock::now();
  began_waiting(since);
  auto next = since + kFirstCheck;
  while (!st->test()) {       // one progress call: a small message may complete here
    if (blocking(s)) return;  // run_to_end(): the blocking wait below does the rest
    const auto now = Clock::now();
    if (now >= deadline(now)) return;
    if (now >= next) {
      check_calls(id);
      if (ctx_.poll != nullptr) poll_caller();
      next = now + kCheckEvery;
    }
    suspend(s, reqs_[id].req, std::min(next, deadline(now)), since);
  }
}

void Exchange::wait_all() {
  for (std::size_t i = first_open_; i < reqs_.size(); ++i) {
    if (reqs_[i].waited) continue;
    wait(i);
  }
}

std::size_t Exchange::bytes(std::size_t id) const {
  return reqs_[id].req.valid() ? reqs_[id].req.bytes() : reqs_[id].moved;
}

std::size_t Exchange::done_inside_call(std::size_t bytes) {
  reqs_.push_back(Posted{Request{}, true, bytes});
  if (first_open_ == reqs_.size() - 1) ++first_open_;
  return reqs_.size() - 1;
}

void Exchange::room_for_scratch() {
  // Doubling: the arena keeps every block it handed out until the call ends.
  if (scratch_.size() == scratch_.capacity())
    scratch_.reserve(std::max<std::size_t>(kInlineScratch, 2 * scratch_.size()));
}

char* Exchange::scratch(std::size_t bytes) {
  if (ctx_.device != nullptr) {
    room_for_scratch();  // so that push_back cannot throw and leak the memory
    void* p = ctx_.device->allocate(bytes);
    scratch_.push_back(Scratch{nullptr, bytes, p});
    return static_cast<char*>(p);
  }
  Pool& p = pool();
  room_for_scratch();
  if (bytes <= kSmallBytes) {
    std::unique_ptr<char[]> b(p.take_small());
    if (!b) b.reset(new char[kSmallBytes]);
    scratch_.push_back(Scratch{std::move(b), kSmallBytes, nullptr});
    return scratch_.back().data.get();
  }
  std::unique_lock<std::mutex> g(p.mu);
  auto b = p.take(bytes);
  g.unlock();
  if (!b.second) b.second.reset(new char[std::max<std::size_t>(bytes, 1)]);
  scratch_.push_back(Scratch{std::move(b.second), b.first, nullptr});
  return scratch_.back().data.get();
}

void Exchange::reduce(void* out, const void* a, const void* b, std::size_t count, DataType t,
                      ReduceOp op) {
  if (count == 0) return;
  if (ctx_.device != nullptr) {
    ctx_.device->reduce(out, a, b, count, t, op);
  } else {
    // A long reduction stops this thread's progress for a while: the transfers still in flight
    // (a rendezvous send the peer waits for) move on in the background meanwhile.
    if (handed_ && count * dtype_size(t) >= kLongReduceBytes) chan_->hand_back();
    reduce_into(out, a, b, count, t, op);
  }
}

void Exchange::copy(void* dst, MemoryType dst_mem, const void* src, MemoryType src_mem,
                    std::size_t bytes) {
  if (bytes == 0 || dst == src) return;
  if (dst_mem == MemoryType::kHost && src_mem == MemoryType::kHost) {
    std::memmove(dst, src, bytes);
    return;
  }
  if (ctx_.device != nullptr) {
    ctx_.device->copy(dst, dst_mem, src, src_mem, bytes);
    return;
  }
  const std::size_t r = recv(dst, bytes, rank_, dst_mem);
  const std::size_t s = send(src, bytes, rank_, src_mem);
  wait(r);
  wait(s);
}

std::string Exchange::cleanup_note() const {
  if (stuck_ == 0) return "";
  return "; " + std::to_string(stuck_) +
         " of its requests did not finish after cancel() and stay "
         "posted (a rendezvous send to a peer that never received it): the call's buffers must "
         "stay allocated until they finish (coll::hold_while_posted)";
}

void Exchange::fail(Errc code, const std::string& what) {
  // A disagreement found here (sizes that differ, say) is told to the other ranks of the call:
  // those still in it fail at once, and the torch backend tells those that finished it before
  // their next collective (ProcessGroupUCX::Impl::check_notices).
  if (code == Errc::kCallMismatch) notify('M', what);
  abort();
  std::string msg = what;
  if (phase_ != nullptr) msg += std::string(" [") + phase_ + "]";
  throw Error(code, ErrorSite{ctx_.op_name, {}, {}, {}, std::to_string(chan_->options().group)},
              msg + cleanup_note());
}

void Exchange::rethrow(const Error& e) {
  const auto failed_at = Clock::now();  // (abort() may wait for cancellations)
  abort();
  // The collective names itself around the failed send or receive ("commux allreduce: recv:
  // timed out ..."), keeps its peer, tag, bytes and group, and is no longer posted: abort()
  // cancelled what was outstanding (cleanup_note() says what did not finish even then).
  ErrorSite site = e.site();
  site.op = ctx_.op_name;
  std::string reason = e.reason();
  if (e.code() == Errc::kTimeout && waiting_since_ != Clock::time_point{}) {
    // The core names its last wait, one slice of this call's (see wait()): say how long it waited.
    reason = with_wait_length(
        std::move(reason),
        std::chrono::duration_cast<std::chrono::milliseconds>(failed_at - waiting_since_).count());
  }
  std::string msg = e.site().op.empty() ? reason : e.site().op + ": " + reason;
  if (phase_ != nullptr) msg += std::string(" [") + phase_ + "]";
  if (e.code() == Errc::kTimeout && stuck_ == 0)
    msg += "; the collective's requests were cancelled";
  if (e.code() == Errc::kTruncated) {
    msg += "; the ranks' sizes disagree";
    notify('M', msg);  // as fail() tells a disagreement
  }
  throw Error(e.code(), std::move(site), msg + cleanup_note());
}

void Exchange::abort() noexcept {
  bool any = false;
  for (std::size_t i = first_open_; i < reqs_.size(); ++i) {
    Request& r = reqs_[i].req;
    if (!r.valid() || r.done()) continue;
    any = true;
    try {
      r.cancel();
    } catch (...) {
    }
  }
  if (!any) return;
  const auto bound = Clock::now() + kCancelBound;
  std::vector<Request> stuck;
  for (std::size_t i = first_open_; i < reqs_.size(); ++i) {
    Request& r = reqs_[i].req;
    if (!r.valid() || r.done()) continue;
    const auto left = bound - Clock::now();
    try {
      r.wait(std::max(std::chrono::milliseconds(0),
                      std::chrono::ceil<std::chrono::milliseconds>(left)));
    } catch (...) {
    }
    if (!r.done()) stuck.push_back(r);
  }
  first_open_ = reqs_.size();
  stuck_ += stuck.size();
  if (stuck.empty()) return;
  try {
    ParkingLot& p = parking();
    std::lock_guard<std::mutex> g(p.mu);
    p.lots.emplace_back();  // what may throw comes before anything is moved
    p.any.store(true, std::memory_order_release);
    Parked& parked = p.lots.back();
    parked.comm = ctx_.comm;
    parked.tag = ctx_.tag;
    parked.scratch.reserve(scratch_.size());
    parked.reqs = std::move(stuck);
    // Device scratch is left allocated (never released): UCX may still write into it, and the
    // DeviceOps that could release it may be gone by the time the request completes.
    for (auto& sc : scratch_) {
      if (sc.data) parked.scratch.push_back(std::move(sc.data));
    }
  } catch (...) {
    // Out of memory while parking: leak the scratch rather than free memory still in use.
    for (auto& sc : scratch_) static_cast<void>(sc.data.release());
  }
  scratch_.clear();
}

WorkStage::WorkStage(Exchange& ex, void* user, std::size_t bytes, bool load)
    : ex_(ex), user_(user), bytes_(bytes), host_(static_cast<char*>(user)) {
  if (ex.mem() == ex.work_mem()) return;
  host_ = ex.scratch(bytes);
  if (load) ex.copy(host_, MemoryType::kHost, user_, ex.mem(), bytes_);
}

void WorkStage::store() {
  if (ex_.mem() == ex_.work_mem()) return;
  ex_.copy(user_, ex_.mem(), host_, MemoryType::kHost, bytes_);
}

}  // namespace commux::coll::detail

namespace commux::coll {

bool hold_while_posted(const Communicator& comm, std::uint32_t first_tag, std::uint32_t ntags,
                       std::shared_ptr<const void> owner) {
  detail::reap_parked();  // what has finished since holds nothing more
  detail::ParkingLot& p = detail::parking();
  if (!p.any.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> g(p.mu);
  bool any = false;
  for (detail::Parked& x : p.lots) {
    // (Wraps with the tag: a range may end past 2^32 - 1.)
    if (x.comm != &comm || x.tag - first_tag >= ntags || x.finished()) continue;
    any = true;
    if (owner) x.held.push_back(owner);  // may throw (out of memory), the owner then held by some
  }
  return any;
}

}  // namespace commux::coll
