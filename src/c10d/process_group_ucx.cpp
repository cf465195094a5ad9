// The torch adapter: maps tensors, dtypes, ReduceOps and c10d::Work onto commux's point-to-point
// (src/core) and collectives (src/collectives). No UCX calls here.
#include "commux/process_group_ucx.hpp"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <utility>

#include "commux/collectives.hpp"
#include "commux/error.hpp"
#include "commux/settings.hpp"
#include "../core/channel.hpp"
#include "device.hpp"
#include "errors.hpp"
#include "torch_compat.hpp"
#include "work.hpp"

namespace commux {

using c10d_detail::Clock;
using c10d_detail::CoalescedWork;
using c10d_detail::CollWork;
using c10d_detail::DeferredWork;
using c10d_detail::memory_type_of;
using c10d_detail::on_device;
using c10d_detail::P2PWork;
using c10d_detail::StreamFence;
using c10d_detail::Task;
using c10d_detail::invalid;

namespace {

constexpr std::size_t kSpinWaitBytes = std::size_t{256} << 10;

// --- Store adapter: torch's (prefix-scoped) c10d::Store as a commux::Store --------------------

class C10dStore final : public Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override {
    store_->set(key, value);
  }
  std::vector<std::uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      store_->wait({key}, timeout);
    } catch (const std::exception& e) {
      throw Error(Errc::kTimeout, "commux init: key '" + key + "' did not appear in the store within " +
                                      std::to_string(timeout.count()) +
                                      " ms (has every rank called init_process_group / new_group?): " +
                                      e.what());
    }
    return store_->get(key);
  }
  bool check(const std::string& key) override { return store_->check({key}); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

DataType to_dtype(const char* op, at::ScalarType s) {
  switch (s) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kBool;
    case at::kComplexFloat: return DataType::kComplex64;
    case at::kComplexDouble: return DataType::kComplex128;
    default: break;
  }
  invalid(op, std::string("dtype ") + c10::toString(s) + " is not supported for reductions");
}

// A ReduceOp as the kernels see it, plus the scaling AVG and PREMUL_SUM need.
struct Reduction {
  ReduceOp op = ReduceOp::kSum;
  double pre_scale = 1.0;  // PREMUL_SUM: applied to the inputs
  bool average = false;    // AVG: the result is divided by the group size
};

const char* c10d_op_name(c10d::ReduceOp::RedOpType t) {
  switch (t) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

// Validated on every rank before anything is posted, so a bad op never leaves peers waiting.
Reduction to_reduction(const char* op, const c10d::ReduceOp& r, at::ScalarType st) {
  const DataType t = to_dtype(op, st);
  Reduction out;
  switch (r.op_) {
    case c10d::ReduceOp::SUM: out.op = ReduceOp::kSum; break;
    case c10d::ReduceOp::PRODUCT: out.op = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: out.op = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: out.op = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: out.op = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: out.op = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: out.op = ReduceOp::kBxor; break;
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::PREMUL_SUM:
      if (!is_floating(t) && !is_complex(t)) {
        invalid(op, std::string("ReduceOp ") + c10d_op_name(r.op_) + " needs a floating-point or "
                    "complex tensor, got " + dtype_name(t) + " (use SUM and divide yourself)");
      }
      out.op = ReduceOp::kSum;
      if (r.op_ == c10d::ReduceOp::AVG) {
        out.average = true;
      } else {
        auto* s = dynamic_cast<torch_compat::PreMulSumSupplement*>(r.supplement_.get());
        if (s == nullptr) invalid(op, "PREMUL_SUM without a factor");
        out.pre_scale = s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
      }
      break;
    default:
      invalid(op, std::string("ReduceOp ") + c10d_op_name(r.op_) + " is not supported");
  }
  try {
    check_reduction(op, t, out.op);
  } catch (const Error& e) {
    c10d_detail::invalid_message(e.what());
  }
  return out;
}

void check_tensor(const char* op, const at::Tensor& t, const char* what = "tensor") {
  if (!t.defined()) invalid(op, std::string(what) + " is undefined");
  if (t.layout() != at::kStrided) invalid(op, std::string(what) + " must be dense (got a sparse tensor)");
  if (!t.is_contiguous()) {
    invalid(op, std::string(what) + " must be contiguous (sizes " + c10::str(t.sizes()) +
                    ", strides " + c10::str(t.strides()) + "); call .contiguous() first");
  }
  memory_type_of(op, t, what);  // a device commux (or its UCX) cannot carry fails here
}

const at::Tensor& single(const char* op, const std::vector<at::Tensor>& ts) {
  if (ts.size() != 1) {
    invalid(op, "expects exactly one tensor per process, got " + std::to_string(ts.size()));
  }
  check_tensor(op, ts[0]);
  return ts[0];
}

// A collective's tensors share one device (its algorithms move one memory type).
void check_device(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what,
                  const char* ref_name = "the input") {
  if (t.device() != ref.device()) {
    invalid(op, std::string(what) + " is on " + t.device().str() + " but " + ref_name + " is on " +
                    ref.device().str() + "; a collective's tensors must share one device");
  }
}

void check_same(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what) {
  check_tensor(op, t, what);
  check_device(op, ref, t, what);
  if (t.scalar_type() != ref.scalar_type()) {
    invalid(op, std::string(what) + " has dtype " + c10::toString(t.scalar_type()) +
                    " but the input has " + c10::toString(ref.scalar_type()));
  }
  if (t.numel() != ref.numel()) {
    invalid(op, std::string(what) + " has " + std::to_string(t.numel()) +
                    " elements but the input has " + std::to_string(ref.numel()));
  }
}

void check_root(const char* op, int64_t root, int size) {
  if (root < 0 || root >= size) {
    invalid(op, "root rank " + std::to_string(root) + " is outside the group (size " +
                    std::to_string(size) + ")");
  }
}

// `big` must hold `size` times the elements of `small` in the same dtype (allgather's output,
// reduce-scatter's input); the names appear in the message ("output 2", ...).
void check_blocks(const char* op, const at::Tensor& small, const std::string& small_name,
                  const at::Tensor& big, const std::string& big_name, int size) {
  check_tensor(op, small, small_name.c_str());
  check_tensor(op, big, big_name.c_str());
  check_device(op, small, big, big_name.c_str(), ("the " + small_name).c_str());
  if (big.scalar_type() != small.scalar_type() || big.numel() != small.numel() * size) {
    invalid(op, big_name + " must have the " + small_name + "'s dtype and " + std::to_string(size) +
                    " times its elements (" + small_name + ": " + std::to_string(small.numel()) +
                    " " + c10::toString(small.scalar_type()) + ", " + big_name + ": " +
                    std::to_string(big.numel()) + " " + c10::toString(big.scalar_type()) + ")");
  }
}

// The root's list of `size` tensors like `ref` (gather's outputs, scatter's inputs); the other
// ranks pass no tensors there.
std::vector<at::Tensor> root_list(const char* op, const std::vector<std::vector<at::Tensor>>& lists,
                                  const at::Tensor& ref, bool is_root, int root, int size,
                                  const std::string& what) {
  if (!is_root) {
    if (!lists.empty() && !lists[0].empty()) {
      invalid(op, "only the root (rank " + std::to_string(root) + ") takes " + what + " tensors");
    }
    return {};
  }
  if (lists.size() != 1 || lists[0].size() != static_cast<std::size_t>(size)) {
    invalid(op, "the root expects one " + what + " list of " + std::to_string(size) + " tensors, got " +
                    (lists.size() == 1 ? std::to_string(lists[0].size()) + " tensors"
                                       : std::to_string(lists.size()) + " lists"));
  }
  const std::string each = what + " tensor";
  for (auto& t : lists[0]) check_same(op, ref, t, each.c_str());
  return lists[0];
}

std::size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

// A contiguous tensor's memory as a flat uint8 tensor (same storage).
at::Tensor byte_view(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(nbytes(t))},
                       at::TensorOptions().dtype(at::kByte).device(t.device()));
}

// PREMUL_SUM scaling; a device tensor is scaled on the current stream (the backend's, on the
// worker thread).
void apply_scale(at::Tensor& t, double f) {
  if (f == 1.0) return;
  if (on_device(t)) {
    t.mul_(f);
  } else {
    scale(t.data_ptr(), t.numel(), to_dtype("scale", t.scalar_type()), f);
  }
}

// AVG: the sum divided by the group size. On a device by a division (correctly rounded in the
// tensor's dtype, as torch's mean), on the host by the kernels' scale(1/size) in double.
void apply_average(at::Tensor& t, int size) {
  if (size == 1) return;
  if (on_device(t)) {
    t.div_(size);
  } else {
    scale(t.data_ptr(), t.numel(), to_dtype("scale", t.scalar_type()), 1.0 / size);
  }
}

int group_number(const std::string& name) {
  if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit) && name.size() < 9) {
    return std::stoi(name) % 256;
  }
  return static_cast<int>(std::hash<std::string>{}(name) % 256);
}

}  // namespace

// --- construction / shutdown -------------------------------------------------------------------

ProcessGroupUCX::ProcessGroupUCX(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout, std::string name,
                                 std::string group_name)
    : c10d::Backend(rank, size),
      name_(std::move(name)),
      group_name_(std::move(group_name)),
      timeout_(timeout) {
  commux::Options o = commux::Options::from_env();
  o.timeout = timeout;
  o.group = group_number(group_name_);
  defer_in_window_ = o.defer_in_window;
  spin_ = o.spin;
  try {
    comm_ = std::make_unique<Communicator>(std::make_shared<C10dStore>(store), rank, size, o);
  } catch (...) {
    c10d_detail::throw_torch_error(std::current_exception());
  }
  // Device tensors are checked against what this UCX can carry before anything is posted.
  c10d_detail::set_ucx_memory_types(comm_->runtime_info().memory_types,
                                    comm_->runtime_info().ucx_version);
  streams_ = std::make_unique<c10d_detail::DeviceStreams>();
  // COMMUX_ATEN_REDUCE=1: CPU collectives also work through the ATen DeviceOps (scratch, local
  // copies and reductions by ATen's CPU kernels) -- the device path's code, checkable without a
  // GPU. Not a speed-up: 1.03-1.35x slower than commux's kernels here (bench/experiments/aten_reduce_ab.py).
  aten_on_cpu_ = commux::Settings::from_environment().aten_reduce;  // read as the group is created
  watcher_ = std::make_shared<c10d_detail::FutureWatcher>();
  worker_ = std::thread([this] { worker_loop(); });
}

ProcessGroupUCX::~ProcessGroupUCX() { shutdown(); }

std::string ProcessGroupUCX::where() const {
  return "group '" + group_name_ + "', rank " + std::to_string(getRank()) + " of " +
         std::to_string(getSize());
}

void ProcessGroupUCX::shutdown() {
  std::deque<std::shared_ptr<Task>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    stopping_ = true;
    left.swap(queue_);
    queued_.store(0, std::memory_order_release);
  }
  cv_.notify_all();
  // Closing the communicator cancels whatever is posted (bounded by the shutdown timeout), so a
  // collective the worker is running fails promptly instead of waiting for its deadline.
  if (comm_) comm_->shutdown();
  if (worker_.joinable()) worker_.join();
  watcher_->stop();  // after comm_->shutdown(): every request has finished
  for (auto& t : left) {
    t->finish(std::make_exception_ptr(Error(
        Errc::kCanceled, std::string("commux ") + t->op_name + ": the process group (" + where() +
                             ") was shut down before the operation ran")));
  }
  std::lock_guard<std::mutex> lk(mu_);
  inflight_.clear();  // everything was cancelled and completed by comm_->shutdown()
}

uint64_t ProcessGroupUCX::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lk(mu_);
  return collectives_issued_;
}

// --- the worker thread ------------------------------------------------------------------------

void ProcessGroupUCX::worker_loop() {
  for (;;) {
    std::shared_ptr<Task> t;
    // Back-to-back collectives (a training step's buckets, a benchmark loop) arrive within
    // microseconds: poll for the next one briefly before sleeping on the condition variable.
    if (spin_.count() > 0 && queued_.load(std::memory_order_acquire) == 0) {
      const auto until = Clock::now() + spin_;
      while (queued_.load(std::memory_order_acquire) == 0 && Clock::now() < until) {
        std::this_thread::yield();
      }
    }
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      t = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_release);
    }
    std::exception_ptr err;
    try {
      run(*t);
    } catch (...) {
      err = std::current_exception();
    }
    t->body = nullptr;
    t->keep_alive.clear();
    t->finish(err);
  }
}

// Runs a task's body on the worker thread. A device collective first waits for the issuing
// stream's work on its tensors (the fence), runs with the backend's stream of that device current
// (so the body's ATen work and the collective's reductions go there), and synchronizes that stream
// before the task completes, so the results are visible to every stream after wait().
void ProcessGroupUCX::run(Task& t) {
  if (t.device.is_cpu()) {
    t.body(t.tag, t.deadline);
    return;
  }
  t.fence.wait(t.deadline, t.op_name);
  streams_->record(t.keep_alive);
  streams_->record(t.outputs);
  c10::StreamGuard g(streams_->stream(t.device));
  t.body(t.tag, t.deadline);
  streams_->sync(t.device);
}

std::chrono::milliseconds ProcessGroupUCX::effective(std::chrono::milliseconds op_timeout) const {
  return op_timeout.count() > 0 ? op_timeout : timeout_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::enqueue(c10d::OpType type, const char* op_name,
                                                       std::chrono::milliseconds op_timeout,
                                                       std::vector<at::Tensor> keep_alive,
                                                       std::vector<at::Tensor> outputs, Body body,
                                                       std::uint32_t ntags) {
  auto t = std::make_shared<Task>();
  t->op_name = op_name;
  t->type = type;
  const auto limit = effective(op_timeout);
  t->deadline = Clock::now() + limit;
  t->keep_alive = std::move(keep_alive);
  t->outputs = std::move(outputs);
  t->body = std::move(body);
  t->future = c10d_detail::make_tensor_list_future();
  // A collective's tensors share one device (validated); on a device, fence the issuing stream.
  for (const auto* list : {&t->outputs, &t->keep_alive}) {
    for (const auto& x : *list) {
      if (on_device(x)) t->device = x.device();
    }
  }
  if (!t->device.is_cpu()) {
    std::vector<at::Tensor> all = t->outputs;
    all.insert(all.end(), t->keep_alive.begin(), t->keep_alive.end());
    t->fence = StreamFence(all);
  }
  // Only a short collective's waiter polls for the result; a long one would take CPU from the
  // worker and the peers for nothing.
  std::size_t bytes = 0;
  for (const auto& o : t->outputs) bytes += nbytes(o);
  const bool small = bytes <= kSpinWaitBytes;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) {
      invalid(op_name, "the process group has been shut down");
    }
    t->tag = next_tag_;
    next_tag_ += ntags;
    ++collectives_issued_;
    t->spin = small ? spin_ : std::chrono::microseconds(0);
    queue_.push_back(t);
    queued_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
  return track(c10::make_intrusive<CollWork>(getRank(), std::move(t), limit, where()));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::track(c10::intrusive_ptr<c10d::Work> work) {
  if (open_windows_.load(std::memory_order_acquire) == 0) return work;  // the p2p fast path
  std::lock_guard<std::mutex> lk(coalesce_mu_);
  const auto me = std::this_thread::get_id();
  for (auto& w : windows_) {
    if (w.thread == me) w.works.push_back(work);
  }
  return work;
}

coll::Context ProcessGroupUCX::context(const char* op_name, std::uint32_t tag,
                                       Clock::time_point deadline, const at::Tensor& like) {
  coll::Context c;
  c.comm = comm_.get();
  c.tag = tag;
  c.deadline = deadline;
  c.op_name = op_name;
  c.mem = MemoryType::kHost;
  if (on_device(like)) {
    // Reductions, scratch and local copies stay on the device, on the backend's stream.
    c.mem = memory_type_of(op_name, like, "tensor");
    c.device = streams_->ops(like.device());
  } else if (aten_on_cpu_ && like.defined()) {
    c.device = streams_->ops(like.device());
  }
  if (c.device != nullptr) device_ops_calls_.fetch_add(1, std::memory_order_relaxed);
  return c;
}

// --- point-to-point -----------------------------------------------------------------------------

void ProcessGroupUCX::reap_locked() {
  while (!inflight_.empty() && inflight_.front()->done()) inflight_.pop_front();
  if (inflight_.size() > 256) {
    inflight_.remove_if([](const c10::intrusive_ptr<P2PWork>& w) { return w->done(); });
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::post_p2p(c10d::OpType type, const char* op_name,
                                                        std::vector<at::Tensor>& tensors, int peer,
                                                        int tag) {
  const bool is_send = type == c10d::OpType::SEND;
  if (tensors.empty()) invalid(op_name, "needs at least one tensor");
  if (peer != kAnySource && (peer < 0 || peer >= getSize())) {
    invalid(op_name, std::string(is_send ? "destination" : "source") + " rank " +
                         std::to_string(peer) + " is outside the group");
  }
  if (tag < 0) {
    invalid(op_name, "tag " + std::to_string(tag) + " is negative; tags are 0 .. 2^31-1");
  }
  for (const auto& t : tensors) check_tensor(op_name, t);
  if (defer_in_window_ && open_windows_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lk(coalesce_mu_);
    const auto me = std::this_thread::get_id();
    for (auto& w : windows_) {
      if (w.thread != me) continue;
      auto d = c10::make_intrusive<DeferredWork>(getRank(), type, op_name, tensors);
      w.deferred.push_back(Deferred{type, tensors, peer, tag, d});
      w.works.push_back(d);
      return d;
    }
  }
  return track(post_now(type, tensors, peer, tag));
}

c10::intrusive_ptr<P2PWork> ProcessGroupUCX::post_now(c10d::OpType type,
                                                      const std::vector<at::Tensor>& tensors,
                                                      int peer, int tag) {
  Buffer bufs[8];
  std::vector<Buffer> many;
  Buffer* b = bufs;
  if (tensors.size() > 8) {
    many.resize(tensors.size());
    b = many.data();
  }
  const char* op = type == c10d::OpType::SEND ? "send" : "recv";
  bool device = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    b[i] = Buffer{tensors[i].data_ptr(), nbytes(tensors[i]), memory_type_of(op, tensors[i], "tensor")};
    device = device || b[i].mem != MemoryType::kHost;
  }
  Request r;
  try {
    // UCX reads (or overwrites) the tensors from now on: the work queued on their streams before
    // this call must be complete. This waits on an event, not on the whole device.
    if (device) StreamFence(tensors).wait(Clock::now() + timeout_, op);
    r = type == c10d::OpType::SEND
            ? commux::detail::channel(*comm_).post_send(b, tensors.size(), peer, TagKind::kUser,
                               static_cast<std::uint32_t>(tag), /*fast_completion=*/true)
            : commux::detail::channel(*comm_).post_recv(b, tensors.size(), peer, TagKind::kUser,
                               static_cast<std::uint32_t>(tag));
  } catch (...) {
    c10d_detail::throw_torch_error(std::current_exception());
  }
  auto w = c10::make_intrusive<P2PWork>(getRank(), type, std::move(r), tensors, timeout_);
  if (!w->done()) {
    w->watcher_ = watcher_;
    std::lock_guard<std::mutex> lk(mu_);
    reap_locked();
    inflight_.push_back(w);
  }
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                    int tag) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return post_p2p(c10d::OpType::SEND, "send", tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                    int tag) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return post_p2p(c10d::OpType::RECV, "recv", tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::recvAnysource(std::vector<at::Tensor>& tensors,
                                                             int tag) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return post_p2p(c10d::OpType::RECVANYSOURCE, "recvAnysource", tensors, kAnySource, tag);
}

// --- coalescing window -------------------------------------------------------------------------

void ProcessGroupUCX::startCoalescing() {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  std::lock_guard<std::mutex> lk(coalesce_mu_);
  const auto me = std::this_thread::get_id();
  for (auto& w : windows_) {
    if (w.thread == me) invalid("startCoalescing", "a coalescing window is already open on this thread");
  }
  windows_.push_back(Window{me, {}, {}});
  open_windows_.fetch_add(1, std::memory_order_release);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::endCoalescing() {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  Window win;
  {
    std::lock_guard<std::mutex> lk(coalesce_mu_);
    const auto me = std::this_thread::get_id();
    auto it = std::find_if(windows_.begin(), windows_.end(),
                           [&](const Window& w) { return w.thread == me; });
    if (it == windows_.end()) invalid("endCoalescing", "no coalescing window is open on this thread");
    win = std::move(*it);
    windows_.erase(it);
    open_windows_.fetch_sub(1, std::memory_order_release);
  }
  // COMMUX_GROUP: post the deferred ops, receives first, each kind in issue order (the order in
  // which same-tag messages from one sender match is kept). A post that fails fails its own Work;
  // the window's Work reports it.
  for (const bool receives : {true, false}) {
    for (auto& d : win.deferred) {
      if ((d.type == c10d::OpType::SEND) == receives) continue;
      try {
        d.work->bind(post_now(d.type, d.tensors, d.peer, d.tag));
      } catch (...) {
        d.work->fail(std::current_exception());
      }
    }
  }
  return c10::make_intrusive<CoalescedWork>(getRank(), std::move(win.works));
}

// --- collectives --------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::barrier(const c10d::BarrierOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return enqueue(c10d::OpType::BARRIER, "barrier", opts.timeout, {}, {},
                 [this](std::uint32_t tag, Clock::time_point dl) {
                   coll::barrier(context("barrier", tag, dl, at::Tensor()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const at::Tensor t = single("broadcast", tensors);
  check_root("broadcast", opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, "broadcast", opts.timeout, {}, tensors,
                 [this, t, root](std::uint32_t tag, Clock::time_point dl) {
                   coll::broadcast(context("broadcast", tag, dl, t), t.data_ptr(), nbytes(t), root);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  at::Tensor t = single("allreduce", tensors);
  const Reduction r = to_reduction("allreduce", opts.reduceOp, t.scalar_type());
  const DataType dt = to_dtype("allreduce", t.scalar_type());
  const int size = getSize();
  return enqueue(c10d::OpType::ALLREDUCE, "allreduce", opts.timeout, {}, tensors,
                 [this, t, r, dt, size](std::uint32_t tag, Clock::time_point dl) mutable {
                   apply_scale(t, r.pre_scale);
                   coll::allreduce(context("allreduce", tag, dl, t), t.data_ptr(), t.numel(), dt, r.op);
                   if (r.average) apply_average(t, size);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allreduce_coalesced";
  if (tensors.empty()) invalid(op, "needs at least one tensor");
  for (auto& t : tensors) {
    check_tensor(op, t);
    check_device(op, tensors[0], t, "a tensor", "the first");
    if (t.scalar_type() != tensors[0].scalar_type()) invalid(op, "all tensors must have one dtype");
  }
  to_reduction(op, opts.reduceOp, tensors[0].scalar_type());  // validate now, on every rank
  std::vector<at::Tensor> ts = tensors;
  const int size = getSize();
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, op, opts.timeout, {}, tensors,
                 [this, ts, op, opts, size](std::uint32_t tag, Clock::time_point dl) {
                   const Reduction red = to_reduction(op, opts.reduceOp, ts[0].scalar_type());
                   std::vector<at::Tensor> flat_parts;
                   for (auto& t : ts) flat_parts.push_back(t.reshape({-1}));
                   at::Tensor flat = at::cat(flat_parts);
                   apply_scale(flat, red.pre_scale);
                   coll::allreduce(context(op, tag, dl, flat), flat.data_ptr(), flat.numel(),
                                   to_dtype(op, flat.scalar_type()), red.op);
                   if (red.average) apply_average(flat, size);
                   int64_t off = 0;
                   for (auto& t : ts) {
                     t.view({-1}).copy_(flat.narrow(0, off, t.numel()));
                     off += t.numel();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  at::Tensor t = single("reduce", tensors);
  check_root("reduce", opts.rootRank, getSize());
  const Reduction r = to_reduction("reduce", opts.reduceOp, t.scalar_type());
  const DataType dt = to_dtype("reduce", t.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  const int size = getSize();
  const bool is_root = getRank() == root;
  return enqueue(c10d::OpType::REDUCE, "reduce", opts.timeout, {}, tensors,
                 [this, t, r, dt, root, size, is_root](std::uint32_t tag, Clock::time_point dl) {
                   // coll::reduce only reads a non-root's buffer; a pre-scale needs a copy.
                   at::Tensor buf = is_root || r.pre_scale == 1.0 ? t : t.clone();
                   apply_scale(buf, r.pre_scale);
                   coll::reduce(context("reduce", tag, dl, buf), buf.data_ptr(), buf.numel(), dt, r.op,
                                root);
                   if (is_root && r.average) apply_average(buf, size);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allgather";
  const at::Tensor in = single(op, inputs);
  if (outputs.size() != 1 || outputs[0].size() != static_cast<std::size_t>(getSize())) {
    invalid(op, "expects one output list of " + std::to_string(getSize()) + " tensors, got " +
                    (outputs.size() == 1 ? std::to_string(outputs[0].size()) + " tensors"
                                         : std::to_string(outputs.size()) + " lists"));
  }
  for (auto& o : outputs[0]) check_same(op, in, o, "output tensor");
  std::vector<at::Tensor> outs = outputs[0];
  return enqueue(c10d::OpType::ALLGATHER, op, opts.timeout, {in}, outs,
                 [this, in, outs, op](std::uint32_t tag, Clock::time_point dl) {
                   at::Tensor flat = at::empty({static_cast<int64_t>(outs.size()) * in.numel()},
                                               in.options());
                   coll::allgather(context(op, tag, dl, in), in.data_ptr(), nbytes(in), flat.data_ptr());
                   for (std::size_t i = 0; i < outs.size(); ++i) {
                     outs[i].view({-1}).copy_(flat.narrow(0, i * in.numel(), in.numel()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "_allgather_base";
  check_blocks(op, input, "input", output, "output", getSize());
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, op, opts.timeout, {in}, {out},
                 [this, in, out, op](std::uint32_t tag, Clock::time_point dl) {
                   coll::allgather(context(op, tag, dl, in), in.data_ptr(), nbytes(in), out.data_ptr());
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allgather_coalesced";
  if (outputs.size() != static_cast<std::size_t>(getSize())) {
    invalid(op, "expects " + std::to_string(getSize()) + " output lists, got " +
                    std::to_string(outputs.size()));
  }
  for (auto& list : outputs) {
    if (list.size() != inputs.size()) invalid(op, "each output list needs one tensor per input");
    for (std::size_t i = 0; i < inputs.size(); ++i) check_same(op, inputs[i], list[i], "output tensor");
  }
  for (auto& in : inputs) {
    check_tensor(op, in, "input");
    check_device(op, inputs[0], in, "an input", "the first");
  }
  std::vector<at::Tensor> outs;
  for (auto& list : outputs) outs.insert(outs.end(), list.begin(), list.end());
  auto ins = inputs;
  auto outlists = outputs;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, op, opts.timeout, ins, outs,
                 [this, ins, outlists, op](std::uint32_t tag, Clock::time_point dl) {
                   for (std::size_t i = 0; i < ins.size(); ++i) {
                     const at::Tensor& in = ins[i];
                     at::Tensor flat = at::empty({static_cast<int64_t>(outlists.size()) * in.numel()},
                                                 in.options());
                     coll::allgather(context(op, tag + i, dl, in), in.data_ptr(), nbytes(in),
                                     flat.data_ptr());
                     for (std::size_t r = 0; r < outlists.size(); ++r) {
                       outlists[r][i].view({-1}).copy_(flat.narrow(0, r * in.numel(), in.numel()));
                     }
                   }
                 },
                 static_cast<std::uint32_t>(std::max<std::size_t>(1, ins.size())));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allgather_into_tensor_coalesced";
  if (outputs.size() != inputs.size()) invalid(op, "needs one output per input");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    // (appended, not "input " + to_string(i): GCC 12's -O3 gives a false -Wrestrict on that)
    std::string in_name = "input ", out_name = "output ";
    in_name += std::to_string(i);
    out_name += std::to_string(i);
    check_blocks(op, inputs[i], in_name, outputs[i], out_name, getSize());
    check_device(op, inputs[0], inputs[i], in_name.c_str(), "input 0");
  }
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, op, opts.timeout, ins, outs,
                 [this, ins, outs, op](std::uint32_t tag, Clock::time_point dl) {
                   for (std::size_t i = 0; i < ins.size(); ++i) {
                     coll::allgather(context(op, tag + i, dl, ins[i]), ins[i].data_ptr(), nbytes(ins[i]),
                                     outs[i].data_ptr());
                   }
                 },
                 static_cast<std::uint32_t>(std::max<std::size_t>(1, ins.size())));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::GatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "gather";
  const at::Tensor in = single(op, inputs);
  check_root(op, opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> outs = root_list(op, outputs, in, getRank() == root, root, getSize(),
                                                 "output");
  return enqueue(c10d::OpType::GATHER, op, opts.timeout, {in}, outs,
                 [this, in, outs, root, op](std::uint32_t tag, Clock::time_point dl) {
                   at::Tensor flat;
                   if (!outs.empty()) {
                     flat = at::empty({static_cast<int64_t>(outs.size()) * in.numel()}, in.options());
                   }
                   coll::gather(context(op, tag, dl, in), in.data_ptr(), nbytes(in),
                                flat.defined() ? flat.data_ptr() : nullptr, root);
                   for (std::size_t i = 0; i < outs.size(); ++i) {
                     outs[i].view({-1}).copy_(flat.narrow(0, i * in.numel(), in.numel()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "scatter";
  const at::Tensor out = single(op, outputs);
  check_root(op, opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> ins = root_list(op, inputs, out, getRank() == root, root, getSize(),
                                                "input");
  return enqueue(c10d::OpType::SCATTER, op, opts.timeout, ins, {out},
                 [this, ins, out, root, op](std::uint32_t tag, Clock::time_point dl) {
                   at::Tensor flat;
                   if (!ins.empty()) {
                     std::vector<at::Tensor> parts;
                     for (auto& i : ins) parts.push_back(i.reshape({-1}));
                     flat = at::cat(parts);
                   }
                   coll::scatter(context(op, tag, dl, out), flat.defined() ? flat.data_ptr() : nullptr,
                                 out.data_ptr(), nbytes(out), root);
                 });
}

namespace {
// The reduce-scatter body shared by the list and the flat-tensor forms: `in` is owned scratch.
void run_reduce_scatter(const coll::Context& ctx, at::Tensor in, at::Tensor out, const Reduction& r,
                        int size) {
  apply_scale(in, r.pre_scale);
  std::vector<std::size_t> counts(size, static_cast<std::size_t>(out.numel()));
  coll::reduce_scatter(ctx, in.data_ptr(), out.data_ptr(), counts.data(),
                       to_dtype(ctx.op_name, in.scalar_type()), r.op);
  if (r.average) apply_average(out, size);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "reduce_scatter";
  const at::Tensor out = single(op, outputs);
  if (inputs.size() != 1 || inputs[0].size() != static_cast<std::size_t>(getSize())) {
    invalid(op, "expects one input list of " + std::to_string(getSize()) + " tensors");
  }
  for (auto& i : inputs[0]) check_same(op, out, i, "input tensor");
  const Reduction r = to_reduction(op, opts.reduceOp, out.scalar_type());
  auto ins = inputs[0];
  const int size = getSize();
  return enqueue(c10d::OpType::REDUCE_SCATTER, op, opts.timeout, ins, {out},
                 [this, ins, out, r, size, op](std::uint32_t tag, Clock::time_point dl) {
                   std::vector<at::Tensor> parts;
                   for (auto& i : ins) parts.push_back(i.reshape({-1}));
                   run_reduce_scatter(context(op, tag, dl, out), at::cat(parts), out, r, size);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "_reduce_scatter_base";
  check_blocks(op, output, "output", input, "input", getSize());
  const Reduction r = to_reduction(op, opts.reduceOp, output.scalar_type());
  at::Tensor in = input, out = output;
  const int size = getSize();
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, op, opts.timeout, {in}, {out},
                 [this, in, out, r, size, op](std::uint32_t tag, Clock::time_point dl) {
                   // The input is not modified: PREMUL_SUM scales a copy.
                   run_reduce_scatter(context(op, tag, dl, out), r.pre_scale != 1.0 ? in.clone() : in,
                                      out, r, size);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "reduce_scatter_tensor_coalesced";
  if (outputs.size() != inputs.size()) invalid(op, "needs one output per input");
  std::vector<Reduction> rs;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::string in_name = "input ", out_name = "output ";
    in_name += std::to_string(i);
    out_name += std::to_string(i);
    check_blocks(op, outputs[i], out_name, inputs[i], in_name, getSize());
    check_device(op, inputs[0], inputs[i], in_name.c_str(), "input 0");
    rs.push_back(to_reduction(op, opts.reduceOp, outputs[i].scalar_type()));
  }
  auto ins = inputs;
  auto outs = outputs;
  const int size = getSize();
  return enqueue(torch_compat::kReduceScatterTensorCoalesced, op, opts.timeout, ins, outs,
                 [this, ins, outs, rs, size, op](std::uint32_t tag, Clock::time_point dl) {
                   for (std::size_t i = 0; i < ins.size(); ++i) {
                     run_reduce_scatter(context(op, tag + i, dl, outs[i]),
                                        rs[i].pre_scale != 1.0 ? ins[i].clone() : ins[i], outs[i],
                                        rs[i], size);
                   }
                 },
                 static_cast<std::uint32_t>(std::max<std::size_t>(1, ins.size())));
}

namespace {
// Split sizes (rows of dim 0) -> byte counts and displacements; empty means even splits.
void split_bytes(const char* op, const char* which, const at::Tensor& t,
                 const std::vector<int64_t>& splits, int size, std::vector<std::size_t>& counts,
                 std::vector<std::size_t>& displs) {
  if (t.dim() == 0) invalid(op, std::string(which) + " must have at least one dimension");
  const int64_t rows = t.size(0);
  const std::size_t row_bytes = rows == 0 ? 0 : nbytes(t) / rows;
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    if (rows % size != 0) {
      invalid(op, std::string(which) + " has " + std::to_string(rows) +
                      " rows, not divisible by the group size " + std::to_string(size) +
                      "; pass split sizes");
    }
    s.assign(size, rows / size);
  }
  if (s.size() != static_cast<std::size_t>(size)) {
    invalid(op, std::string(which) + " split sizes have " + std::to_string(s.size()) +
                    " entries but the group has " + std::to_string(size) + " ranks");
  }
  int64_t sum = 0;
  for (auto v : s) {
    if (v < 0) invalid(op, std::string(which) + " split sizes contain a negative entry");
    sum += v;
  }
  if (sum != rows) {
    invalid(op, std::string(which) + " split sizes add up to " + std::to_string(sum) +
                    " but the tensor has " + std::to_string(rows) + " rows");
  }
  counts.resize(size);
  displs.resize(size);
  std::size_t off = 0;
  for (int i = 0; i < size; ++i) {
    counts[i] = static_cast<std::size_t>(s[i]) * row_bytes;
    displs[i] = off;
    off += counts[i];
  }
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& outputSplitSizes,
                                                             std::vector<int64_t>& inputSplitSizes,
                                                             const c10d::AllToAllOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "alltoall_base";
  check_tensor(op, input, "input");
  check_tensor(op, output, "output");
  check_device(op, input, output, "the output");
  if (input.scalar_type() != output.scalar_type()) invalid(op, "input and output dtypes differ");
  std::vector<std::size_t> sc, sd, rc, rd;
  split_bytes(op, "input", input, inputSplitSizes, getSize(), sc, sd);
  split_bytes(op, "output", output, outputSplitSizes, getSize(), rc, rd);
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::ALLTOALL_BASE, op, opts.timeout, {in}, {out},
                 [this, in, out, sc, sd, rc, rd, op](std::uint32_t tag, Clock::time_point dl) {
                   coll::alltoallv(context(op, tag, dl, in), in.data_ptr(), sc.data(), sd.data(),
                                   out.data_ptr(), rc.data(), rd.data());
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "alltoall";
  const auto n = static_cast<std::size_t>(getSize());
  if (inputs.size() != n || outputs.size() != n) {
    invalid(op, "expects " + std::to_string(n) + " input and output tensors, got " +
                    std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  std::vector<std::size_t> sc(n), sd(n), rc(n), rd(n);
  std::size_t so = 0, ro = 0;
  for (std::size_t i = 0; i < n; ++i) {
    check_tensor(op, inputs[i], "input");
    check_tensor(op, outputs[i], "output");
    check_device(op, inputs[0], inputs[i], "an input", "input 0");
    check_device(op, inputs[0], outputs[i], "an output", "input 0");
    if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
        outputs[i].scalar_type() != inputs[0].scalar_type()) {
      invalid(op, "all tensors must have one dtype");
    }
    sc[i] = nbytes(inputs[i]);
    sd[i] = so;
    so += sc[i];
    rc[i] = nbytes(outputs[i]);
    rd[i] = ro;
    ro += rc[i];
  }
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(c10d::OpType::ALLTOALL, op, opts.timeout, ins, outs,
                 [this, ins, outs, sc, sd, rc, rd, so, ro, op](std::uint32_t tag,
                                                               Clock::time_point dl) {
                   // Packed into one send and one receive buffer (bytes), on the tensors' device.
                   const auto bytes = at::TensorOptions().dtype(at::kByte).device(ins[0].device());
                   at::Tensor sbuf = at::empty({static_cast<int64_t>(so)}, bytes);
                   at::Tensor rbuf = at::empty({static_cast<int64_t>(ro)}, bytes);
                   for (std::size_t i = 0; i < ins.size(); ++i) {
                     if (sc[i] == 0) continue;
                     sbuf.narrow(0, static_cast<int64_t>(sd[i]), static_cast<int64_t>(sc[i]))
                         .copy_(byte_view(ins[i]));
                   }
                   coll::alltoallv(context(op, tag, dl, sbuf), sbuf.data_ptr(), sc.data(), sd.data(),
                                   rbuf.data_ptr(), rc.data(), rd.data());
                   for (std::size_t i = 0; i < outs.size(); ++i) {
                     if (rc[i] == 0) continue;
                     byte_view(outs[i]).copy_(
                         rbuf.narrow(0, static_cast<int64_t>(rd[i]), static_cast<int64_t>(rc[i])));
                   }
                 });
}

}  // namespace commux
