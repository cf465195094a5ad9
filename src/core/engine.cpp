// The UCX engine: context, worker, endpoints, requests, progress. The threading contract is in
// docs/progress.md; the tag layout in include/commux/tag.hpp.
#include "engine.hpp"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

#include "commux/transports.hpp"
#include "status.hpp"
#include "ucx_config.hpp"

namespace commux::detail {

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kNoInfo = ~std::size_t{0};
constexpr std::chrono::microseconds kMaxSpin{20000};

ucs_memory_type_t to_ucs(MemoryType m) {
  switch (m) {
    case MemoryType::kHost: return UCS_MEMORY_TYPE_HOST;
    case MemoryType::kCuda: return UCS_MEMORY_TYPE_CUDA;
    case MemoryType::kCudaManaged: return UCS_MEMORY_TYPE_CUDA_MANAGED;
    case MemoryType::kRocm: return UCS_MEMORY_TYPE_ROCM;
#if UCP_API_VERSION >= UCP_VERSION(1, 15)  // Intel GPU (Level Zero) memory arrived in UCX 1.15
    case MemoryType::kZe: return UCS_MEMORY_TYPE_ZE_DEVICE;
#else
    case MemoryType::kZe: return UCS_MEMORY_TYPE_LAST;  // unsupported: validate() rejects it
#endif
    case MemoryType::kUnknown: return UCS_MEMORY_TYPE_UNKNOWN;
  }
  return UCS_MEMORY_TYPE_UNKNOWN;
}

std::string addr_key(const Options& o, int rank) {
  return o.store_prefix + "/g" + std::to_string(o.group) + "/addr/" + std::to_string(rank);
}

// The transports UCX would use, read from ucp_context_print_info ("... flags -- tl/dev" lines).
std::vector<std::string> query_transports(ucp_context_h context) {
  std::vector<std::string> out;
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return out;
  ucp_context_print_info(context, f);
  std::fclose(f);
  std::istringstream in(std::string(buf, len));
  std::free(buf);
  std::set<std::string> seen;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("resource") == std::string::npos) continue;
    const auto slash = line.rfind('/');
    const auto space = line.rfind(' ', slash);
    if (slash == std::string::npos || space == std::string::npos) continue;
    std::string tl = line.substr(space + 1, slash - space - 1);
    if (!tl.empty() && seen.insert(tl).second) out.push_back(tl);
  }
  return out;
}

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
    throw Error(Errc::kInvalidArgument,
                "commux init: group id " + std::to_string(options_.group) + " is outside 0.." +
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
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Engine::start() {
  use_wakeup_ = options_.wakeup == Options::Wakeup::kOn ||
                (options_.wakeup == Options::Wakeup::kAuto &&
                 tls_excludes_shared_memory(std::getenv("UCX_TLS")));
  ucp_config_t* config = nullptr;
  check_status(ucp_config_read(nullptr, nullptr, &config), "init: reading the UCX configuration");
  info_.applied_defaults = apply_ucx_defaults(config, &info_.user_settings);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG;
  // UCP_FEATURE_WAKEUP makes UCX drop every transport without wakeup events -- shared memory
  // among them (a two-rank job on one host then runs over TCP loopback, 80x slower). So the
  // event fd is used only where no shared-memory transport could be chosen anyway.
  if (use_wakeup_) params.features |= UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.estimated_num_eps = static_cast<std::size_t>(size_);
  const ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check_status(st, "init: ucp_init");

  info_.ucx_version = ucp_get_version_string();
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  check_status(ucp_context_query(context_, &attr), "init: ucp_context_query");
  for (int m = 0; m < UCS_MEMORY_TYPE_LAST; ++m) {
    if (attr.memory_types & (std::uint64_t{1} << m)) {
      info_.memory_types.emplace_back(ucs_memory_type_names[m]);
    }
  }
  info_.transports = query_transports(context_);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // serialised by worker_mu_
  check_status(ucp_worker_create(context_, &wp, &worker_), "init: ucp_worker_create");
  if (!use_wakeup_ || ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
  info_.event_fd = efd_ >= 0;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw Error(Errc::kTransport, "commux init: eventfd failed");

  ucp_address_t* address = nullptr;
  std::size_t address_len = 0;
  check_status(ucp_worker_get_address(worker_, &address, &address_len),
               "init: ucp_worker_get_address");
  const auto* a = reinterpret_cast<const std::uint8_t*>(address);
  const ProcessIdentity me = self_identity();
  store_->set(addr_key(options_, rank_),
              encode_record(PeerRecord{me, std::vector<std::uint8_t>(a, a + address_len)}));
  ucp_worker_release_address(worker_, address);

  peer_status_.assign(static_cast<std::size_t>(size_), UCS_OK);
  peer_failed_at_.assign(static_cast<std::size_t>(size_), Clock::time_point{});
  peer_reason_.assign(static_cast<std::size_t>(size_), std::string());
  peer_identity_.assign(static_cast<std::size_t>(size_), ProcessIdentity{});
  peer_same_host_.assign(static_cast<std::size_t>(size_), false);
  ep_args_.resize(static_cast<std::size_t>(size_));
  eps_.assign(static_cast<std::size_t>(size_), nullptr);
  for (int p = 0; p < size_; ++p) {
    // Start with the right-hand neighbour so ranks do not all wait on rank 0's key first.
    const int peer = (rank_ + p) % size_;
    const PeerRecord remote = decode_record(store_->get(addr_key(options_, peer), options_.timeout),
                                            "rank " + std::to_string(peer));
    const auto pi = static_cast<std::size_t>(peer);
    peer_identity_[pi] = remote.identity;
    peer_same_host_[pi] = remote.identity.host == me.host;
    ep_args_[pi] = {this, peer};
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.address.data());
    // Peer error handling would cost same-host peers their shared-memory transports (see
    // peer_record.hpp); those are watched by check_local_peers() instead.
    ep.err_mode = peer_same_host_[pi] ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Engine::ep_error_cb;
    ep.err_handler.arg = &ep_args_[static_cast<std::size_t>(peer)];
    std::lock_guard<std::mutex> lock(worker_mu_);
    const ucs_status_t created = ucp_ep_create(worker_, &ep, &eps_[pi]);
    if (created != UCS_OK && peer_same_host_[pi]) {
      // A peer may finish its work (eager sends to us included) and leave before we connect;
      // its shared memory is gone then. That is a peer that left, not a failed start: messages
      // it sent are still delivered, and operations that need it fail naming this reason.
      eps_[pi] = nullptr;
      fail_peer_locked(peer, created,
                       std::string("could not connect to its process ") +
                           std::to_string(remote.identity.pid) + " on this host (" +
                           ucs_status_string(created) + "): it has probably left already");
      continue;
    }
    check_status(created, "init: connecting to peer " + std::to_string(peer));
  }
  progress_thread_ = std::thread([this] { progress_thread_main(); });
  {
    LiveEngines& le = live_engines();
    std::lock_guard<std::mutex> lk(le.mu);
    le.engines.insert(this);
  }
}

// ---------------------------------------------------------------------------------------------
// Posting

void Engine::validate(Op::Kind kind, const char* name, const Buffer* buffers, std::size_t count,
                      int peer) const {
  const bool any_ok = kind == Op::Kind::kRecv;
  if (peer >= size_ || peer < 0) {
    if (!(any_ok && peer == kAnySource)) {
      throw Error(Errc::kInvalidArgument, ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                  "peer " + std::to_string(peer) +
                      " is outside 0.." + std::to_string(size_ - 1) +
                      (any_ok ? " (or kAnySource)" : "") + " (world size " +
                      std::to_string(size_) + ")");
    }
  }
  if (count > 0 && buffers == nullptr) {
    throw Error(Errc::kInvalidArgument, ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                "null buffer list with count " +
                    std::to_string(count));
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (buffers[i].data == nullptr && buffers[i].size > 0) {
      throw Error(Errc::kInvalidArgument, ErrorSite{name, peer, {}, {}, std::to_string(options_.group)}, "buffer " +
                                              std::to_string(i) + " is null but has " +
                                              std::to_string(buffers[i].size) + " bytes");
    }
    const MemoryType m = buffers[i].mem;
    if (m != MemoryType::kHost && m != MemoryType::kUnknown) {
      const ucs_memory_type_t u = to_ucs(m);
      if (u == UCS_MEMORY_TYPE_LAST ||
          std::find(info_.memory_types.begin(), info_.memory_types.end(),
                    ucs_memory_type_names[u]) == info_.memory_types.end()) {
        throw Error(Errc::kUnsupported, ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                    "buffer " + std::to_string(i) + " is " +
                        memory_type_name(m) + " memory, but the UCX in use (" + info_.ucx_version +
                        ") does not support it; build commux against a UCX with that transport "
                        "(e.g. COMMUX_UCX_PROVIDER=wheel with libucx-cu13 for CUDA)");
      }
    }
    if (options_.packing == Packing::kIov && count > 1 && m != buffers[0].mem) {
      throw Error(Errc::kInvalidArgument, ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                  std::string("COMMUX_COALESCE packs the buffers into one UCX message, so they "
                              "must share one memory type (buffer 0 is ") + memory_type_name(buffers[0].mem) +
                      ", buffer " + std::to_string(i) + " is " + memory_type_name(m) + ")");
    }
  }
}

std::shared_ptr<Op> Engine::post_op(Op::Kind kind, const char* name, const Buffer* buffers,
                                 std::size_t count, int peer, TagKind tag_kind, std::uint32_t tag,
                                 bool fast_completion) {
  validate(kind, name, buffers, count, peer);
  auto op = std::make_shared<Op>();
  op->kind = kind;
  op->name = name;
  op->peer = peer;
  op->tag_kind = tag_kind;
  op->tag = tag;
  op->buffers.resize(count);
  std::copy(buffers, buffers + count, op->buffers.begin());
  for (const Buffer& b : op->buffers) op->capacity += b.size;
  op->packing = (count > 1 && options_.packing == Packing::kIov) ? Packing::kIov : Packing::kParts;
  if (op->packing == Packing::kIov) {
    op->iov.reserve(count);
    for (const Buffer& b : op->buffers) op->iov.push_back(ucp_dt_iov_t{b.data, b.size});
  }
  const std::size_t nparts = op->packing == Packing::kIov ? 1 : std::max<std::size_t>(count, 1);
  op->parts.resize(nparts);
  for (std::size_t i = 0; i < nparts; ++i) {
    op->parts[i].op = op.get();
    op->parts[i].index = static_cast<std::uint32_t>(i);
  }
  op->engine = shared_from_this();
  op->source = peer;

  std::lock_guard<std::mutex> lock(worker_mu_);
  if (shut_down_) {
    throw Error(Errc::kCanceled, ErrorSite{name, peer, tag, op->capacity, std::to_string(options_.group)}, "the communicator is shut down");
  }
  // Sends to a peer that is gone fail at once. Receives are still posted: a message it sent before
  // it went may be waiting; reap_failed_peers_locked() fails them if nothing matches.
  if (kind == Op::Kind::kSend && peer_status_[static_cast<std::size_t>(peer)] != UCS_OK) {
    throw Error(Errc::kPeerFailed, ErrorSite{name, peer, tag, op->capacity, std::to_string(options_.group)},
                "peer " + std::to_string(peer) + " is gone (" +
                    peer_reason_[static_cast<std::size_t>(peer)] + "); " + describe(*op));
  }
  register_locked(op);
  // An any-source receive in parts learns its sender from part 0, then posts the rest.
  const bool later_rest = kind == Op::Kind::kRecv && peer == kAnySource && nparts > 1;
  op->remaining = later_rest ? 1 : static_cast<int>(nparts);
  post_locked(op, 0, fast_completion);
  return op;
}

void Engine::post_locked(const std::shared_ptr<Op>& op, std::size_t first_part,
                         bool fast_completion) {
  const bool later_rest = op->kind == Op::Kind::kRecv && op->peer == kAnySource && first_part == 0 &&
                          op->parts.size() > 1;
  const std::size_t end = later_rest ? 1 : op->parts.size();
  for (std::size_t i = first_part; i < end; ++i) post_part_locked(*op, i, fast_completion);
  run_deferred_locked();
}

// Work that completion callbacks may not do themselves (it would re-enter UCX or the op):
// posting the rest of an any-source multi-part receive, cancelling the rest of a failed one.
void Engine::run_deferred_locked() {
  while (!deferred_.empty() || !to_cancel_.empty()) {
    auto ready = std::move(deferred_);
    deferred_.clear();
    for (auto& d : ready) post_locked(d, 1, false);
    auto cancel = std::move(to_cancel_);
    to_cancel_.clear();
    for (auto& op : cancel) {
      for (Part& p : op->parts) {
        if (p.ucx_req != nullptr) ucp_request_cancel(worker_, p.ucx_req);
      }
    }
  }
}

void Engine::post_part_locked(Op& op, std::size_t index, bool fast_completion) {
  Part& part = op.parts[index];
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.user_data = &part;
  void* buf = nullptr;
  std::size_t cnt = 0;
  MemoryType mem = MemoryType::kHost;
  if (op.packing == Packing::kIov) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    prm.datatype = ucp_dt_make_iov();
    buf = op.iov.data();
    cnt = op.iov.size();
    mem = op.buffers[0].mem;
  } else if (!op.buffers.empty()) {
    buf = op.buffers[index].data;
    cnt = op.buffers[index].size;
    mem = op.buffers[index].mem;
  }
  if (mem != MemoryType::kUnknown) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    prm.memory_type = to_ucs(mem);
  }
  const bool continuation = index > 0;
  ucs_status_ptr_t r;
  if (op.kind == Op::Kind::kSend) {
    prm.cb.send = &Engine::send_cb;
    if (fast_completion) prm.op_attr_mask |= UCP_OP_ATTR_FLAG_FAST_CMPL;
    TagFields f;
    f.sender = rank_;
    f.group = options_.group;
    f.kind = op.tag_kind;
    f.continuation = continuation;
    f.packing = op.packing;
    f.user = op.tag;
    r = ucp_tag_send_nbx(eps_[static_cast<std::size_t>(op.peer)], buf, cnt, make_tag(f).bits, &prm);
  } else {
    prm.cb.recv = &Engine::recv_cb;
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    // Always complete receives through the callback: on immediate completion UCX does not always
    // fill in recv_info (1.13: zero-byte messages; 1.22: some truncated ones), which would lose
    // the sender, the length and the packing check.
    prm.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm.recv_info.tag_info = &part.info;
    part.info.length = kNoInfo;  // tells whether UCX filled it in on an immediate failure
    const int sender = continuation ? op.source : op.peer;
    const RecvMatch m = recv_match(sender, options_.group, op.tag_kind, continuation, op.tag);
    r = ucp_tag_recv_nbx(worker_, buf, cnt, m.tag.bits, m.mask.bits, &prm);
  }
  if (UCS_PTR_IS_ERR(r)) {
    const bool filled = op.kind == Op::Kind::kRecv && part.info.length != kNoInfo;
    part_done_locked(op, part.index, UCS_PTR_STATUS(r), filled ? &part.info : nullptr);
  } else if (r == nullptr) {
    part_done_locked(op, part.index, UCS_OK, op.kind == Op::Kind::kRecv ? &part.info : nullptr);
  } else {
    part.ucx_req = r;
  }
}

void Engine::register_locked(const std::shared_ptr<Op>& op) {
  op->self = op;
  op->next = inflight_;
  if (inflight_ != nullptr) inflight_->prev = op.get();
  inflight_ = op.get();
  inflight_count_.fetch_add(1);
}

std::shared_ptr<Op> Engine::unregister_locked(Op& op) {
  if (!op.self) return nullptr;
  if (op.prev != nullptr) op.prev->next = op.next;
  if (op.next != nullptr) op.next->prev = op.prev;
  if (inflight_ == &op) inflight_ = op.next;
  op.prev = op.next = nullptr;
  inflight_count_.fetch_sub(1);
  return std::move(op.self);
}

std::vector<std::shared_ptr<Op>> Engine::inflight_snapshot_locked() const {
  std::vector<std::shared_ptr<Op>> out;
  for (Op* op = inflight_; op != nullptr; op = op->next) out.push_back(op->self);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Completion (runs inside ucp_worker_progress or inline after posting; worker_mu_ held)

void Engine::send_cb(void* request, ucs_status_t status, void* user_data) {
  auto* part = static_cast<Part*>(user_data);
  Op* op = part->op;
  part->ucx_req = nullptr;
  ucp_request_free(request);
  op->engine->part_done_locked(*op, part->index, status, nullptr);
}

void Engine::recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data) {
  auto* part = static_cast<Part*>(user_data);
  Op* op = part->op;
  part->ucx_req = nullptr;
  const ucp_tag_recv_info_t copy = info != nullptr ? *info : ucp_tag_recv_info_t{};
  ucp_request_free(request);
  op->engine->part_done_locked(*op, part->index, status, info != nullptr ? &copy : nullptr);
}

void Engine::part_done_locked(Op& op, std::uint32_t index, ucs_status_t status,
                              const ucp_tag_recv_info_t* info) {
  if (op.kind == Op::Kind::kRecv) {
    if (info != nullptr && (status == UCS_OK || status == UCS_ERR_MESSAGE_TRUNCATED)) {
      const TagFields f = parse_tag(TagValue{info->sender_tag});
      if (index == 0) op.source = f.sender;
      const std::size_t posted =
          op.packing == Packing::kIov ? op.capacity
                                      : (op.buffers.empty() ? 0 : op.buffers[index].size);
      if (status == UCS_ERR_MESSAGE_TRUNCATED) {
        op.detail = "the message is " + std::to_string(info->length) +
                    " bytes but the posted buffer" +
                    (op.parts.size() > 1 ? " " + std::to_string(index) : std::string()) +
                    " holds " + std::to_string(posted) + " bytes";
      } else {
        op.bytes += info->length;
      }
      if (f.packing != op.packing && !op.has_override) {
        op.has_override = true;
        op.override_code = Errc::kWireMismatch;
        op.override_reason =
            "peer " + std::to_string(f.sender) + " sent " +
            (f.packing == Packing::kIov ? "a packed (IOV) multi-buffer message"
                                        : "a message in separate parts") +
            " but this receive expects " +
            (op.packing == Packing::kIov ? "a packed one" : "separate parts") +
            ": COMMUX_COALESCE must have the same value on every rank and the buffer counts must "
            "match";
        if (op.remaining > 1) to_cancel_.push_back(op.self);  // the rest never comes
      }
    }
  } else if (status == UCS_OK) {
    op.bytes += op.packing == Packing::kIov ? op.capacity
                                            : (op.buffers.empty() ? 0 : op.buffers[index].size);
  }
  if (status == UCS_ERR_MESSAGE_TRUNCATED && info == nullptr) {
    op.detail = "the message is longer than the " + std::to_string(op.capacity) +
                "-byte buffer posted (UCX did not report its length)";
  }
  if (status != UCS_OK && op.status == UCS_OK) op.status = status;
  if (op.kind == Op::Kind::kRecv && op.peer == kAnySource && index == 0 && op.parts.size() > 1 &&
      status == UCS_OK && !op.has_override) {
    op.remaining += static_cast<int>(op.parts.size()) - 1;
    deferred_.push_back(op.self);
  }
  if (--op.remaining == 0) finish_locked(op);
}

void Engine::finish_locked(Op& op) {
  if (op.has_override) {
    op.error = std::make_exception_ptr(Error(
        op.override_code, ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)},
        op.override_reason + " (" + describe(op) + ")"));
  } else if (op.status == UCS_ERR_MESSAGE_TRUNCATED) {
    op.error = std::make_exception_ptr(
        Error(Errc::kTruncated, ErrorSite{op.name, op.source, op.tag, op.capacity, std::to_string(options_.group)},
              "message from peer " +
                                    std::to_string(op.source) + " with tag " +
                                    std::to_string(op.tag) + " is too long: " + op.detail + " (" +
                                    describe(op) + ")"));
  } else if (op.status != UCS_OK) {
    op.error = std::make_exception_ptr(error_from_status(
        op.status, ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)}, describe(op)));
  }
  const std::shared_ptr<Op> keep = unregister_locked(op);  // keeps op alive to the end of this
  op.done.store(true);
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> g(done_mu_); }
    done_cv_.notify_all();
  }
}

void Engine::ep_error_cb(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* a = static_cast<std::pair<Engine*, int>*>(arg);
  a->first->fail_peer_locked(a->second, status, ucs_status_string(status));
}

void Engine::fail_peer_locked(int peer, ucs_status_t status, const std::string& reason) {
  // Sends to the peer are failed by UCX (peer error handling) or by the force-close below.
  // Receives are worker-level: messages the peer sent before it went may still be in flight, so
  // receives are failed later, once progress is idle and a grace period has passed
  // (reap_failed_peers_locked).
  const auto p = static_cast<std::size_t>(peer);
  if (peer_status_[p] != UCS_OK) return;
  peer_status_[p] = status;
  peer_failed_at_[p] = Clock::now();
  peer_reason_[p] = reason;
  any_peer_failed_ = true;
  for (Op* op = inflight_; op != nullptr; op = op->next) {
    if (op->kind == Op::Kind::kSend && op->peer == peer && !op->has_override) {
      op->has_override = true;
      op->override_code = Errc::kPeerFailed;
      op->override_reason = "peer " + std::to_string(peer) + " is gone (" + reason + ")";
    }
  }
}

void Engine::check_local_peers() {
  std::vector<int> dead;
  for (int p = 0; p < size_; ++p) {
    const auto pi = static_cast<std::size_t>(p);
    if (p != rank_ && peer_same_host_[pi] && !process_alive(peer_identity_[pi])) dead.push_back(p);
  }
  if (dead.empty()) return;
  std::lock_guard<std::mutex> lock(worker_mu_);
  if (shut_down_) return;
  for (int p : dead) {
    const auto pi = static_cast<std::size_t>(p);
    if (peer_status_[pi] != UCS_OK) continue;
    fail_peer_locked(p, UCS_ERR_CONNECTION_RESET,
                     "its process " + std::to_string(peer_identity_[pi].pid) +
                         " on this host has exited");
    // Force-closing completes the sends still queued to it (with an error) and frees them.
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(eps_[pi], &prm);
    if (UCS_PTR_IS_PTR(r)) closing_.push_back(r);
    eps_[pi] = nullptr;
  }
}

void Engine::reap_failed_peers_locked() {
  constexpr auto kGrace = std::chrono::milliseconds(100);
  const auto now = Clock::now();
  if (now < next_reap_) return;
  next_reap_ = now + std::chrono::milliseconds(10);
  std::vector<std::shared_ptr<Op>> victims;
  for (Op* op = inflight_; op != nullptr; op = op->next) {
    if (op->kind != Op::Kind::kRecv || op->has_override) continue;
    const int from = op->peer != kAnySource ? op->peer : (op->remaining > 0 && op->parts.size() > 1 &&
                                                          op->parts[0].ucx_req == nullptr
                                                              ? op->source
                                                              : kAnySource);
    if (from == kAnySource) continue;
    const auto p = static_cast<std::size_t>(from);
    if (peer_status_[p] != UCS_OK && now - peer_failed_at_[p] >= kGrace) victims.push_back(op->self);
  }
  for (auto& op : victims) {
    const auto p = static_cast<std::size_t>(op->peer != kAnySource ? op->peer : op->source);
    op->has_override = true;
    op->override_code = Errc::kPeerFailed;
    op->override_reason = "peer " + std::to_string(p) + " is gone (" + peer_reason_[p] +
                          ") and no matching message from it had arrived";
    for (Part& part : op->parts) {
      if (part.ucx_req != nullptr) ucp_request_cancel(worker_, part.ucx_req);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Progress and waiting

unsigned Engine::progress_locked() {
  if (worker_ == nullptr || shut_down_) return 0;
  const unsigned n = ucp_worker_progress(worker_);
  run_deferred_locked();
  if (n == 0 && any_peer_failed_) reap_failed_peers_locked();
  return n;
}

void Engine::kick() {
  if (wake_fd_ < 0) return;
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t w = ::write(wake_fd_, &one, sizeof(one));
}

void Engine::progress_thread_main() {
  // Polling mode backs off from 5 us to a cap while nothing happens: responsive right after
  // traffic, nearly free when idle.
  constexpr auto kMinIdle = std::chrono::microseconds(5);
  auto idle = kMinIdle;
  auto next_check = Clock::now();
  while (!stop_.load()) {
    if (inflight_count_.load() > 0 && Clock::now() >= next_check) {
      check_local_peers();
      next_check = Clock::now() + std::chrono::milliseconds(200);
    }
    if (spinners_.load() > 0) {
      // A user thread is progressing: stay off the CPU until it stops (or 10 ms pass).
      wait_for_kick(std::chrono::milliseconds(10), -1);
      idle = kMinIdle;
      continue;
    }
    unsigned n = 0;
    bool busy = false;
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      if (shut_down_) break;
      for (int i = 0; i < 256; ++i) {
        const unsigned k = progress_locked();
        n += k;
        if (k == 0) break;
      }
      if (efd_ >= 0 && n == 0) busy = ucp_worker_arm(worker_) == UCS_ERR_BUSY;
    }
    const bool in_flight = inflight_count_.load() > 0;
    if (efd_ >= 0) {
      if (n > 0 || busy) continue;
      // Event mode: sleep until the worker's fd fires; wake at least every 10 ms while work is in
      // flight (transports whose pending queues raise no event, keepalive).
      wait_for_kick(std::chrono::milliseconds(in_flight ? 10 : 100), efd_);
      continue;
    }
    if (n > 0) {
      idle = kMinIdle;
      continue;
    }
    // Grow by 1/4 per idle poll: the interval stays about a fifth of the time since the last
    // activity, so a completion is noticed late by at most ~20% of the wait, and a long wait
    // settles at the cap (1 ms while work is in flight, 20 ms otherwise).
    const auto cap = in_flight ? std::chrono::microseconds(1000) : std::chrono::microseconds(20000);
    idle = std::min(idle + idle / 4 + std::chrono::microseconds(1), cap);
    if (wait_for_kick(idle, -1)) idle = kMinIdle;
  }
}

bool Engine::wait_for_kick(std::chrono::microseconds timeout, int other_fd) {
  pollfd fds[2] = {pollfd{wake_fd_, POLLIN, 0}, pollfd{other_fd, POLLIN, 0}};
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  const timespec ts{static_cast<time_t>(secs.count()),
                    static_cast<long>((timeout - secs).count() * 1000)};
  const int r = ::ppoll(fds, other_fd >= 0 ? 2 : 1, &ts, nullptr);
  if (r > 0 && (fds[0].revents & POLLIN)) {
    std::uint64_t drain = 0;
    [[maybe_unused]] const ssize_t got = ::read(wake_fd_, &drain, sizeof(drain));
    return true;
  }
  return false;
}

Request Engine::post(Direction dir, const char* name, const Buffer* buffers, std::size_t count,
                     int peer, TagKind kind, std::uint32_t tag, bool fast_completion) {
  return make_request(post_op(dir == Direction::kSend ? Op::Kind::kSend : Op::Kind::kRecv, name,
                              buffers, count, peer, kind, tag, fast_completion));
}

bool Op::test() { return engine->test(*this); }
void Op::wait_for(std::chrono::milliseconds timeout) { engine->wait(*this, timeout); }
void Op::request_cancel() { engine->cancel(*this); }
std::chrono::milliseconds Op::default_timeout() const noexcept { return engine->options().timeout; }

bool Engine::test(Op& op) {
  if (op.done.load()) return true;
  std::unique_lock<std::mutex> lock(worker_mu_, std::try_to_lock);
  if (lock.owns_lock()) progress_locked();
  return op.done.load();
}

void Engine::wait(Op& op, std::chrono::milliseconds timeout) {
  if (op.done.load()) return;
  {  // one progress call before anything else: most small messages complete here
    std::lock_guard<std::mutex> lock(worker_mu_);
    progress_locked();
  }
  if (op.done.load()) return;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // Spin at least options_.spin, and longer for large messages: while a rendezvous of N bytes
  // is under way its completion is expected within about N / (2 GB/s), and sleeping through
  // it would add the progress thread's poll interval to every large transfer.
  const auto expected = std::chrono::microseconds(op.capacity / 2000);
  const auto spin_until = std::min(
      deadline, start + std::clamp<std::chrono::microseconds>(expected, options_.spin, kMaxSpin));
  spinners_.fetch_add(1);
  for (unsigned iter = 1; !op.done.load(); ++iter) {
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      progress_locked();
    }
    if ((iter & 15) == 0 && Clock::now() >= spin_until) break;
  }
  const int left = spinners_.fetch_sub(1) - 1;
  if (op.done.load()) {
    // Hand background progress back to the progress thread if others still have work in flight.
    if (left == 0 && inflight_count_.load() > 0) kick();
    return;
  }
  sleepers_.fetch_add(1);
  kick();
  {
    std::unique_lock<std::mutex> lock(done_mu_);
    done_cv_.wait_until(lock, deadline, [&] { return op.done.load(); });
  }
  sleepers_.fetch_sub(1);
  if (!op.done.load()) {
    std::string d;
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      d = describe(op);
    }
    throw Error(Errc::kTimeout, ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)},
                "timed out after " +
                                    std::to_string(timeout.count()) + " ms (" + d + ")");
  }
}

void Engine::cancel(Op& op) {
  std::lock_guard<std::mutex> lock(worker_mu_);
  if (op.done.load() || shut_down_) return;
  for (Part& p : op.parts) {
    if (p.ucx_req != nullptr) ucp_request_cancel(worker_, p.ucx_req);
  }
}

std::string Engine::describe(const Op& op) const {
  std::string s = op.kind == Op::Kind::kSend ? "to peer " : "from ";
  if (op.kind == Op::Kind::kRecv) {
    s += op.peer == kAnySource ? "any source" : "peer " + std::to_string(op.peer);
  } else {
    s += std::to_string(op.peer);
  }
  s += ", tag " + std::to_string(op.tag);
  if (op.tag_kind == TagKind::kInternal) s += " (internal)";
  s += ", " + std::to_string(op.capacity) + " bytes";
  if (op.buffers.size() > 1) s += " in " + std::to_string(op.buffers.size()) + " buffers";
  s += ", group " + std::to_string(options_.group) + ", rank " + std::to_string(rank_) + " of " +
       std::to_string(size_);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Shutdown: bounded in time whatever the peers do.

void Engine::shutdown() {
  stop_.store(true);
  kick();
  if (progress_thread_.joinable()) progress_thread_.join();
  std::lock_guard<std::mutex> lock(worker_mu_);
  if (shut_down_) return;
  const auto deadline = Clock::now() + options_.shutdown_timeout;
  std::vector<std::shared_ptr<Op>> pending = inflight_snapshot_locked();
  for (auto& op : pending) {
    if (!op->has_override) {
      op->has_override = true;
      op->override_code = Errc::kCanceled;
      op->override_reason = "the communicator was shut down while the operation was in flight";
    }
    if (op->kind == Op::Kind::kRecv && worker_ != nullptr) {
      for (Part& p : op->parts) {
        if (p.ucx_req != nullptr) ucp_request_cancel(worker_, p.ucx_req);
      }
    }
  }
  if (worker_ != nullptr) {
    std::vector<void*> closing;
    for (std::size_t p = 0; p < eps_.size(); ++p) {  // dead same-host peers are already closed
      if (eps_[p] == nullptr) continue;
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = peer_status_.size() > p && peer_status_[p] != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* r = ucp_ep_close_nbx(eps_[p], &prm);
      if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
      eps_[p] = nullptr;
    }
    while (!closing.empty() && Clock::now() < deadline) {
      if (ucp_worker_progress(worker_) == 0) ::usleep(50);
      closing.erase(std::remove_if(closing.begin(), closing.end(),
                                   [](void* r) {
                                     if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                     ucp_request_free(r);
                                     return true;
                                   }),
                    closing.end());
    }
    for (void* r : closing) ucp_request_free(r);  // released by UCX when the worker goes
    for (void* r : closing_) ucp_request_free(r);
    closing_.clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (context_ != nullptr) {
    ucp_cleanup(context_);
    context_ = nullptr;
  }
  shut_down_ = true;
  pending = inflight_snapshot_locked();
  for (auto& op : pending) {
    if (op->status == UCS_OK) op->status = UCS_ERR_CANCELED;
    op->remaining = 0;
    finish_locked(*op);
  }
  deferred_.clear();
  // wake_fd_ stays open until ~Engine: waiting threads kick() it without the lock, and each of
  // them holds the Engine alive through its Op, so none can be using it once it is closed.
}

}  // namespace commux::detail

namespace commux {

std::vector<std::string> ucx_available_transports() {
  ucp_config_t* config = nullptr;
  detail::check_status(ucp_config_read(nullptr, nullptr, &config),
               "transport probe: reading the UCX configuration");
  // Every transport, whatever UCX_TLS says: the question is what this UCX has.
  ucp_config_modify(config, "TLS", "all");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h context = nullptr;
  const ucs_status_t st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  detail::check_status(st, "transport probe: ucp_init");
  std::vector<std::string> out = detail::query_transports(context);
  ucp_cleanup(context);
  return out;
}

}  // namespace commux
