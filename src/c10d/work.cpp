#include "work.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <thread>

#include "commux/error.hpp"
#include "flight_recorder.hpp"
#include "watcher.hpp"

namespace commux::c10d_detail {

c10::intrusive_ptr<c10::ivalue::Future> make_tensor_list_future() {
  // (torch's shared List[Tensor] type: creating one per call was a measurable part of it.)
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
}

// --- interrupts (Ctrl-C) ----------------------------------------------------------------------

namespace {
std::atomic<bool (*)()> g_interrupt_here{nullptr};
std::atomic<void (*)()> g_interrupt_check{nullptr};
thread_local std::uint64_t tl_interrupts = 0;
}  // namespace

void set_interrupt_hook(InterruptHook hook) noexcept {
  g_interrupt_check.store(hook.check);
  g_interrupt_here.store(hook.here);
}

bool interruptible() noexcept {
  auto here = g_interrupt_here.load(std::memory_order_acquire);
  return here != nullptr && g_interrupt_check.load(std::memory_order_acquire) != nullptr && here();
}

void check_interrupt() {
  auto check = g_interrupt_check.load(std::memory_order_acquire);
  if (check == nullptr) return;
  try {
    check();
  } catch (...) {
    ++tl_interrupts;
    throw;
  }
}

std::uint64_t interrupts_raised() noexcept { return tl_interrupts; }

void poll_interrupt() {
  thread_local Clock::time_point next{};
  const auto now = Clock::now();
  if (now < next) return;
  next = now + kInterruptPoll;
  check_interrupt();
}

// --- Task / CollWork -------------------------------------------------------------------------

c10::intrusive_ptr<c10::ivalue::Future> Task::finish(std::exception_ptr e, bool settle_here) {
  e = to_torch_error(e);
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> lk(mu);
    error = e;
    done = true;
    finished.store(true, std::memory_order_release);
    f = future;
  }
  cv.notify_all();
  // Future callbacks (DDP comm hooks) run here, on the finishing thread, outside our lock. A
  // future asked for after this is settled by get_future().
  if (f && settle_here) {
    settle(*f);
    return {};
  }
  return f;
}

c10::intrusive_ptr<c10::ivalue::Future> Task::get_future() {
  c10::intrusive_ptr<c10::ivalue::Future> f;
  bool settle_now = false;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (!future) {
      future = make_tensor_list_future();
      settle_now = done;  // finish() has run and saw no future: settle it here
    }
    f = future;
  }
  if (settle_now) settle(*f);
  return f;
}

namespace {
std::atomic<int> g_completing{0};
std::atomic<bool> g_quiesced{false};
thread_local bool t_commux_thread = false;
}  // namespace

CallbackScope::CallbackScope() noexcept {
  g_completing.fetch_add(1);
  allowed_ = !t_commux_thread || !g_quiesced.load();
}

void CallbackScope::on_commux_thread() noexcept { t_commux_thread = true; }

CallbackScope::~CallbackScope() { g_completing.fetch_sub(1); }

bool quiesce_callbacks(std::chrono::milliseconds timeout) {
  g_quiesced.store(true);
  const auto until = Clock::now() + timeout;
  while (g_completing.load() > 0) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void Task::settle(c10::ivalue::Future& f) {
  CallbackScope scope;
  if (!scope.allowed()) return;  // the interpreter is exiting
  if (error) {
    f.setError(error);
    return;
  }
  std::vector<at::Tensor> value;
  try {
    value = result_tensors();
  } catch (...) {
    f.setError(std::current_exception());  // a released output freed: the future fails, loudly
    return;
  }
  f.markCompleted(c10::IValue(std::move(value)));
}

bool release_weakly(std::vector<at::Tensor>& outputs, WeakOutputs& weak) {
  // (An undefined tensor has no weak reference that could tell it from a freed one; nor has it a
  // Python object to let go of.)
  for (const auto& o : outputs) {
    if (!o.defined()) return false;
  }
  weak.reserve(outputs.size());
  for (const auto& o : outputs) weak.emplace_back(o.getIntrusivePtr());
  outputs.clear();  // not their last reference: torch's binding holds them until the call returns
  return true;
}

std::vector<at::Tensor> lock_outputs(const char* op_name, const WeakOutputs& weak) {
  std::vector<at::Tensor> out;
  out.reserve(weak.size());
  for (const auto& w : weak) {
    auto p = w.lock();
    if (!p) {
      invalid(op_name,
              "result() of a blocking call (asyncOp false) needs its tensors alive, and one of "
              "them has been freed (keep it, or call with asyncOp true)");
    }
    out.emplace_back(std::move(p));
  }
  return out;
}

void Task::release_outputs() { outputs_released = release_weakly(outputs, weak_outputs); }

std::vector<at::Tensor> Task::result_tensors() const {
  return outputs_released ? lock_outputs(op_name, weak_outputs) : outputs;
}

DoneWork::DoneWork(int rank, c10d::OpType type, const char* op_name,
                   std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), op_name_(op_name), outputs_(std::move(outputs)) {
  released_ = release_weakly(outputs_, weak_);
}

std::vector<at::Tensor> DoneWork::result() {
  return released_ ? lock_outputs(op_name_, weak_) : outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> DoneWork::getFuture() {
  std::lock_guard<std::mutex> lk(future_mu_);
  if (future_) return future_;
  future_ = make_tensor_list_future();
  // (Completed before anyone holds it: no callback runs here.)
  try {
    future_->markCompleted(c10::IValue(result()));
  } catch (...) {
    future_->setError(std::current_exception());  // a released output freed: it fails, loudly
  }
  return future_;
}

CollWork::CollWork(int rank, std::shared_ptr<Task> task, std::chrono::milliseconds default_timeout,
                   std::shared_ptr<const std::string> where)
    : c10d::Work(rank, task->type),
      task_(std::move(task)),
      default_timeout_(default_timeout),
      where_(std::move(where)) {}

bool CollWork::isCompleted() {
  std::lock_guard<std::mutex> lk(task_->mu);
  return task_->done;
}

bool CollWork::isSuccess() const {
  std::lock_guard<std::mutex> lk(task_->mu);
  return task_->done && !task_->error;
}

std::exception_ptr CollWork::exception() const {
  std::lock_guard<std::mutex> lk(task_->mu);
  return task_->error;
}

void CollWork::run_here(Clock::time_point until, bool may_block) {
  TaskRunner* runner = nullptr;
  {
    RunnerGate& gate = *task_->gate;
    std::lock_guard<std::mutex> lk(gate.mu);
    if (gate.runner != nullptr && gate.runner->enter()) runner = gate.runner;
  }
  if (runner == nullptr) return;
  struct Leave {
    TaskRunner* r;
    ~Leave() { r->leave(); }
  } leave{runner};
  runner->run_through(task_, until, may_block);
}

bool CollWork::wait(std::chrono::milliseconds timeout) {
  // A blocking call's Work (its caller ran it) is finished: report, no clock read, no lock (the
  // error was set before `finished`).
  if (task_->finished.load(std::memory_order_acquire)) {
    if (task_->error) std::rethrow_exception(task_->error);
    return true;
  }
  const auto limit = timeout.count() > 0 ? timeout : default_timeout_;
  // The task itself fails at its deadline; the extra time covers its hang report (which asks the
  // other ranks, FlightRecorder::kAnswerWait at most) and the wake-up.
  const auto slack = timeout.count() > 0 ? std::chrono::milliseconds(0)
                                         : FlightRecorder::kAnswerWait + std::chrono::seconds(1);
  const auto until = Clock::now() + limit + slack;
  // The waiting thread works for the collective itself, so that it costs no hand-off to the
  // collective thread and back: it starts it if no thread has, and resumes it (and the group's
  // other schedules) as its requests complete. A collective that cannot run as a schedule runs
  // here only if the wait's limit is not shorter than the collective's own deadline (it must be
  // able to return at that limit).
  if (task_->gate != nullptr && !task_->finished.load(std::memory_order_acquire)) {
    run_here(until, timeout.count() <= 0 || Clock::now() + timeout >= task_->deadline);
  }
  // A short collective finishes within microseconds: poll (yielding the CPU to the worker and the
  // peer) before paying a futex sleep and wake-up.
  if (task_->spin.count() > 0 && !task_->finished.load(std::memory_order_acquire)) {
    const auto spin_until = Clock::now() + task_->spin;
    while (!task_->finished.load(std::memory_order_acquire) && Clock::now() < spin_until) {
      std::this_thread::yield();
    }
  }
  std::unique_lock<std::mutex> lk(task_->mu);
  const auto done = [&] { return task_->done; };
  bool finished = false;
  if (!interruptible()) {
    finished = task_->cv.wait_until(lk, until, done);
  } else {
    // Ctrl-C: the KeyboardInterrupt leaves the collective running on the worker thread, in its
    // place in the group's order (it completes, or fails at its deadline).
    for (;;) {
      finished = task_->cv.wait_until(lk, std::min(until, Clock::now() + kInterruptPoll), done);
      if (finished || Clock::now() >= until) break;
      lk.unlock();
      check_interrupt();
      lk.lock();
    }
  }
  if (!finished) {
    throw_torch_error(std::make_exception_ptr(
        Error(Errc::kTimeout, ErrorSite{task_->op_name, {}, task_->tag, {}, {}},
              "not complete after " + std::to_string(limit.count()) + " ms (" + *where_ +
                  "); the operation is still in flight")));
  }
  if (task_->error) std::rethrow_exception(task_->error);
  return true;
}

// --- P2PWork ---------------------------------------------------------------------------------

P2PWork::P2PWork(int rank, c10d::OpType type, Request request, std::vector<at::Tensor> tensors,
                 std::chrono::milliseconds default_timeout, std::chrono::milliseconds cancel_bound,
                 std::shared_ptr<const std::string> exact_where, int tag)
    : c10d::Work(rank, type),
      request_(std::move(request)),
      tensors_(std::move(tensors)),
      exact_where_(std::move(exact_where)),
      tag_(tag),
      default_timeout_(default_timeout),
      cancel_bound_(cancel_bound),
      // (Only a future of an unfinished request times out from it: one finished in its call, a
      // small send or a message that was there, reads no clock.)
      posted_(request_.done() ? Clock::time_point{} : Clock::now()) {
  if (exact_where_) {
    for (const auto& t : tensors_) exact_bytes_ += t.numel() * t.element_size();
  }
}

std::exception_ptr P2PWork::outcome() const {
  if (!request_.done()) return nullptr;
  auto e = request_.error();
  if (e || !exact_where_) return e;
  const std::size_t got = request_.bytes();
  if (got == exact_bytes_) return nullptr;
  // A longer message fails in UCX (kTruncated); a shorter one arrives whole and would leave the
  // rest of the tensors as they were, with nothing to tell the caller.
  const int from = request_.source();
  std::string held = std::to_string(exact_bytes_) + " bytes";
  if (tensors_.size() > 1) {
    held = "the " + std::to_string(tensors_.size()) + " tensors posted for it hold " + held + " (";
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      held += (i ? " + " : "") + std::to_string(tensors_[i].numel() * tensors_[i].element_size());
    }
    held += ")";
  } else {
    held = "the tensor posted for it holds " + held;
  }
  return std::make_exception_ptr(Error(
      Errc::kCallMismatch,
      ErrorSite{retrieveOpType() == c10d::OpType::RECVANYSOURCE ? "recvAnysource" : "recv",
                from,
                static_cast<std::uint64_t>(tag_),
                exact_bytes_,
                {}},
      "the message from rank " + std::to_string(from) + " with tag " + std::to_string(tag_) +
          " is " + std::to_string(got) + " bytes, but " + held + " (" + *exact_where_ +
          "). A receive must be filled exactly: torch cannot say how much arrived, so the rest "
          "would be stale. Send and receive tensors of the same size (send the size first if it "
          "varies)"));
}

bool P2PWork::isCompleted() {
  if (!request_.done() && !request_.test()) return false;
  release();
  return true;
}

bool P2PWork::isSuccess() const { return request_.done() && !outcome(); }

std::exception_ptr P2PWork::exception() const { return to_torch_error(outcome()); }

int P2PWork::sourceRank() const {
  if (!request_.done()) {
    throw_value_error("commux recvAnysource: sourceRank() is only valid after wait() has returned");
  }
  return request_.source();
}

namespace {
bool is_canceled(const std::exception_ptr& e) {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return err.code() == Errc::kCanceled;
  } catch (...) {
    return false;
  }
}

// What a timed-out p2p operation became after the cancellation was asked for: nullptr when it
// matched after all (a success), else the error to report.
std::exception_ptr after_cancel(const Request& r, std::exception_ptr outcome, const Error& timeout,
                                std::chrono::milliseconds bound) {
  if (!r.done()) {
    return std::make_exception_ptr(Error(
        Errc::kTimeout, timeout.site(),
        timeout.reason() + "; cancelling it did not finish within " +
            std::to_string(bound.count()) +
            " ms, so it stays posted (the process group keeps its tensors alive until it finishes "
            "or the group is shut down)",
        /*still_posted=*/true));
  }
  auto e = std::move(outcome);
  if (!e) return nullptr;
  if (is_canceled(e)) {
    return std::make_exception_ptr(
        Error(Errc::kTimeout, timeout.site(),
              timeout.reason() + "; the operation was cancelled: it will not take a later message "
                                 "(post a new one to receive or send it)"));
  }
  return e;  // it failed by itself meanwhile: that is the outcome
}
}  // namespace

void P2PWork::cancel_after_timeout(const Error& timeout) {
  {
    std::lock_guard<std::mutex> lk(future_mu_);
    if (timeout_reason_.empty()) timeout_reason_ = timeout.reason();
  }
  cancel_asked_.store(true);
  request_.cancel();
  try {
    request_.wait(cancel_bound_);
  } catch (...) {
    // Read below: still posted, cancelled, or failed by itself.
  }
  if (auto e = after_cancel(request_, outcome(), timeout, cancel_bound_)) {
    if (request_.done()) release();
    throw_torch_error(e);
  }
}

void P2PWork::release() {
  if (released_.load(std::memory_order_acquire)) return;
  auto w = watcher_.lock();
  if (!w || w->release(this)) released_.store(true, std::memory_order_release);
}

void P2PWork::wait_request(std::chrono::milliseconds limit) {
  if (!interruptible()) {
    request_.wait(limit);
    return;
  }
  const auto deadline = Clock::now() + limit;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left <= kInterruptPoll) {
      try {
        request_.wait(std::max(left, std::chrono::milliseconds(0)));
      } catch (const Error& e) {
        if (e.code() != Errc::kTimeout) throw;
        // The core names the last slice's length: the wait lasted `limit`.
        throw Error(e.code(), e.site(), with_wait_length(e.reason(), limit.count()),
                    e.still_posted());
      }
      return;
    }
    try {
      request_.wait(kInterruptPoll);
      return;
    } catch (const Error& e) {
      if (e.code() != Errc::kTimeout) throw;
      if (request_.done()) {
        if (auto err = request_.error()) std::rethrow_exception(err);
        return;
      }
    }
    try {
      check_interrupt();
    } catch (...) {
      // Cancelled so that it cannot take a later message; the backend keeps it (and its tensors)
      // until the cancellation has finished.
      {
        std::lock_guard<std::mutex> lk(future_mu_);
        if (timeout_reason_.empty())
          timeout_reason_ = "the wait was interrupted (KeyboardInterrupt)";
      }
      cancel_asked_.store(true);
      request_.cancel();
      throw;
    }
  }
}

bool P2PWork::wait(std::chrono::milliseconds timeout) {
  // (A finished request has nothing to wait for: its failure, if any, is the outcome below.)
  if (!request_.done()) {
    try {
      wait_request(timeout.count() > 0 ? timeout : default_timeout_);
    } catch (const Error& e) {
      if (e.code() == Errc::kTimeout && !request_.done()) {
        cancel_after_timeout(e);  // returns when it matched while being cancelled
      } else {
        release();
        throw_torch_error(std::current_exception());
      }
    } catch (...) {
      throw_torch_error(std::current_exception());
    }
  }
  release();
  if (auto e = outcome()) throw_torch_error(e);  // the request's failure, or a short message
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> P2PWork::getFuture() {
  std::lock_guard<std::mutex> lk(future_mu_);
  if (!future_) {
    future_ = make_tensor_list_future();
    if (!request_.done()) {
      if (auto w = watcher_.lock()) {
        w->add(c10::intrusive_ptr<P2PWork>::reclaim_copy(this));
        return future_;
      }
      future_->setError(to_torch_error(std::make_exception_ptr(
          Error(Errc::kCanceled,
                "commux p2p: the process group was shut down before the operation finished"))));
      return future_;
    }
    if (auto e = outcome()) {
      future_->setError(to_torch_error(e));
    } else {
      future_->markCompleted(c10::IValue(tensors_));
    }
  }
  return future_;
}

namespace {
const char* p2p_name(c10d::OpType t) {
  switch (t) {
    case c10d::OpType::SEND: return "send";
    case c10d::OpType::RECV: return "recv";
    case c10d::OpType::RECVANYSOURCE: return "recvAnysource";
    default: return "p2p";
  }
}
}  // namespace

bool P2PWork::poll_future() {
  // One settler at a time (the watcher, a waiter releasing the Work); a future callback that
  // comes back here on the same Work finds the lock taken and leaves it to the settler.
  std::unique_lock<std::mutex> settling(settle_mu_, std::try_to_lock);
  if (!settling.owns_lock()) return false;
  CallbackScope scope;
  // The interpreter is exiting: settle nothing more; keep the Work while UCX may use its tensors.
  if (!scope.allowed()) return request_.done();
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> lk(future_mu_);
    f = future_;
  }
  const bool pending = f && !f->completed();
  // Without a pending future, only whether it finished matters (the core's progress thread
  // drives it); with one, drive progress too, as the future's waiter would.
  if (!request_.done() && !(pending && request_.test())) {
    if (!pending) return false;
    // Like wait(), the future does not outlive the group timeout: the operation is cancelled,
    // and the future settles once the cancellation has finished (or could not).
    const auto timeout_at = posted_ + default_timeout_;
    const auto now = Clock::now();
    if (now < timeout_at) return false;
    if (!cancel_asked_.exchange(true)) {
      {
        std::lock_guard<std::mutex> lk(future_mu_);
        if (timeout_reason_.empty()) {
          timeout_reason_ =
              "the future timed out after " + std::to_string(default_timeout_.count()) + " ms";
        }
      }
      request_.cancel();
    }
    if (now < timeout_at + cancel_bound_) return false;
    f->setError(to_torch_error(after_cancel(request_, outcome(), timeout_error(), cancel_bound_)));
    return false;  // still posted: the backend keeps it until it finishes
  }
  if (pending) {
    auto e = outcome();
    if (e && cancel_asked_.load())
      e = after_cancel(request_, outcome(), timeout_error(), cancel_bound_);
    if (e) {
      f->setError(to_torch_error(e));
    } else {
      f->markCompleted(c10::IValue(tensors_));
    }
  }
  return true;
}

Error P2PWork::timeout_error() {
  std::lock_guard<std::mutex> lk(future_mu_);
  return Error(Errc::kTimeout, ErrorSite{p2p_name(retrieveOpType()), {}, {}, {}, {}},
               timeout_reason_.empty() ? std::string("timed out") : timeout_reason_);
}

// --- DeferredWork ------------------------------------------------------------------------------

DeferredWork::DeferredWork(int rank, c10d::OpType type, const char* op_name,
                           std::vector<at::Tensor> tensors)
    : c10d::Work(rank, type), op_name_(op_name), tensors_(std::move(tensors)) {}

void DeferredWork::not_posted(const char* what) const {
  throw_value_error(std::string("commux ") + op_name_ + ": " + what +
                    " before endCoalescing(): with COMMUX_GROUP=1 the operations of "
                    "a coalescing window are posted when it ends (wait on the Work "
                    "endCoalescing() returns)");
}

namespace {
void forward_future(c10::intrusive_ptr<c10::ivalue::Future> to, c10d::Work& from) {
  from.getFuture()->addCallback([to](c10::ivalue::Future& f) {
    if (f.hasError()) {
      to->setError(f.exception_ptr());
    } else {
      to->markCompleted(f.value());
    }
  });
}
}  // namespace

void DeferredWork::bind(c10::intrusive_ptr<c10d::Work> real) {
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> lk(mu_);
    real_ = std::move(real);
    f = future_;
  }
  if (f) forward_future(f, *real_);
}

void DeferredWork::fail(std::exception_ptr e) {
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = to_torch_error(e);
    f = future_;
  }
  if (f) f->setError(error_);
}

bool DeferredWork::isCompleted() {
  std::unique_lock<std::mutex> lk(mu_);
  if (real_) {
    auto r = real_;
    lk.unlock();
    return r->isCompleted();
  }
  return error_ != nullptr;
}

bool DeferredWork::isSuccess() const {
  std::lock_guard<std::mutex> lk(mu_);
  return real_ && real_->isSuccess();
}

std::exception_ptr DeferredWork::exception() const {
  std::lock_guard<std::mutex> lk(mu_);
  return real_ ? real_->exception() : error_;
}

int DeferredWork::sourceRank() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!real_) not_posted("sourceRank() was asked for");
  return real_->sourceRank();
}

bool DeferredWork::wait(std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10d::Work> r;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_) std::rethrow_exception(error_);
    if (!real_) not_posted("wait() was called");
    r = real_;
  }
  return r->wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> DeferredWork::getFuture() {
  std::lock_guard<std::mutex> lk(mu_);
  if (real_) return real_->getFuture();
  if (!future_) {
    future_ = make_tensor_list_future();
    if (error_) future_->setError(error_);
  }
  return future_;
}

// --- CoalescedWork -----------------------------------------------------------------------------

CoalescedWork::CoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
    : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}

bool CoalescedWork::isCompleted() {
  for (auto& w : works_) {
    if (!w->isCompleted()) return false;
  }
  return true;
}

bool CoalescedWork::isSuccess() const {
  for (auto& w : works_) {
    if (!w->isSuccess()) return false;
  }
  return true;
}

std::exception_ptr CoalescedWork::exception() const {
  for (auto& w : works_) {
    if (auto e = w->exception()) return e;
  }
  return nullptr;
}

std::vector<at::Tensor> CoalescedWork::result() {
  std::vector<at::Tensor> out;
  for (auto& w : works_) {
    auto r = w->result();
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  // One deadline for the whole window. Every Work is waited on even after a failure, so the
  // first error is reported only once nothing of the window is left running unobserved.
  const auto start = Clock::now();
  std::exception_ptr first;
  for (auto& w : works_) {
    auto left = timeout;
    if (timeout.count() > 0) {
      left = timeout - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      if (left.count() <= 0) left = std::chrono::milliseconds(1);
    }
    const std::uint64_t interrupts = interrupts_raised();
    try {
      w->wait(left);
    } catch (...) {
      if (interrupts_raised() != interrupts) throw;  // Ctrl-C: at once
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  auto all = make_tensor_list_future();
  if (works_.empty()) {
    all->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    return all;
  }
  struct Join {
    std::mutex mu;
    std::size_t left;
    std::exception_ptr error;
  };
  auto join = std::make_shared<Join>();
  join->left = works_.size();
  auto outputs = result();
  for (auto& w : works_) {
    w->getFuture()->addCallback([join, all, outputs](c10::ivalue::Future& f) {
      bool last = false;
      std::exception_ptr e;
      {
        std::lock_guard<std::mutex> lk(join->mu);
        if (f.hasError() && !join->error) join->error = f.exception_ptr();
        last = --join->left == 0;
        e = join->error;
      }
      if (!last) return;
      if (e) {
        all->setError(e);
      } else {
        all->markCompleted(c10::IValue(outputs));
      }
    });
  }
  return all;
}

}  // namespace commux::c10d_detail
