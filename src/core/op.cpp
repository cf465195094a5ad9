// Requests: posting an operation, UCX's completion callbacks, finishing it, describing it in
// errors. Everything here runs with the worker mutex held unless it takes it itself; the tag
// layout is in include/commux/tag.hpp, the threading contract in docs/progress.md.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>

#include "engine.hpp"
#include "log.hpp"
#include "status.hpp"

namespace commux::detail {

namespace {
constexpr std::size_t kNoInfo = ~std::size_t{0};
// Engine::send_now always tries messages up to this size (Peer::send_now_max).
constexpr std::size_t kSendNowFloor = 64;
}  // namespace

// ---------------------------------------------------------------------------------------------
// Posting

void Engine::validate(Op::Kind kind, const char* name, const Buffer* buffers, std::size_t count,
                      int peer) const {
  const bool any_ok = kind == Op::Kind::kRecv;
  if (peer >= size_ || peer < 0) {
    if (!(any_ok && peer == kAnySource)) {
      throw Error(Errc::kInvalidArgument,
                  ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                  "peer " + std::to_string(peer) + " is outside 0.." + std::to_string(size_ - 1) +
                      (any_ok ? " (or kAnySource)" : "") + " (world size " + std::to_string(size_) +
                      ")");
    }
  }
  if (count > 0 && buffers == nullptr) {
    throw Error(Errc::kInvalidArgument,
                ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                "null buffer list with count " + std::to_string(count));
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (buffers[i].data == nullptr && buffers[i].size > 0) {
      throw Error(Errc::kInvalidArgument,
                  ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                  "buffer " + std::to_string(i) + " is null but has " +
                      std::to_string(buffers[i].size) + " bytes");
    }
    const MemoryType m = buffers[i].mem;
    if (!info_.supports(m)) {
      throw Error(Errc::kUnsupported, ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                  "buffer " + std::to_string(i) + " is " + memory_type_name(m) +
                      " memory, but the UCX in use (" + info_.ucx_version +
                      ") does not support it; build commux against a UCX with that transport "
                      "(e.g. COMMUX_UCX_PROVIDER=wheel with libucx-cu13 for CUDA)");
    }
    if (options_.packing == Packing::kIov && count > 1 && m != buffers[0].mem) {
      throw Error(Errc::kInvalidArgument,
                  ErrorSite{name, peer, {}, {}, std::to_string(options_.group)},
                  std::string("COMMUX_COALESCE packs the buffers into one UCX message, so they "
                              "must share one memory type (buffer 0 is ") +
                      memory_type_name(buffers[0].mem) + ", buffer " + std::to_string(i) + " is " +
                      memory_type_name(m) + ")");
    }
  }
}

std::shared_ptr<Op> Engine::make_op(Op::Kind kind, const char* name, const Buffer* buffers,
                                    std::size_t count, int peer, TagKind tag_kind,
                                    std::uint32_t tag) {
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
  return op;
}

std::shared_ptr<Op> Engine::post_op(Op::Kind kind, const char* name, const Buffer* buffers,
                                    std::size_t count, int peer, TagKind tag_kind,
                                    std::uint32_t tag, bool fast_completion,
                                    std::shared_ptr<Gate> gate) {
  validate(kind, name, buffers, count, peer);
  std::shared_ptr<Op> op = make_op(kind, name, buffers, count, peer, tag_kind, tag);

  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (shut_down_ || worker_.shut_down_locked()) {
    throw Error(Errc::kCanceled,
                ErrorSite{name, peer, tag, op->capacity, std::to_string(options_.group)},
                "the communicator is shut down");
  }
  // Sends to a peer that is gone fail at once. Receives are still posted: a message it sent before
  // it went may be waiting; Peers::reap_locked() fails them if nothing matches.
  if (kind == Op::Kind::kSend && peers_[peer].status != UCS_OK) {
    throw Error(Errc::kPeerFailed,
                ErrorSite{name, peer, tag, op->capacity, std::to_string(options_.group)},
                "peer " + std::to_string(peer) + " is gone (" + peers_[peer].reason + "); " +
                    describe(*op));
  }
  if (tag_kind == TagKind::kInternal) {
    const int gone = peers_.group_broken_locked();
    if (gone >= 0) {
      throw Error(Errc::kPeerFailed,
                  ErrorSite{name, peer, tag, op->capacity, std::to_string(options_.group)},
                  peers_.gone(gone) + ", so no collective of its group can complete; " +
                      describe(*op));
    }
  }
  enqueue_locked(op, fast_completion, std::move(gate));
  return op;
}

void Engine::enqueue_locked(const std::shared_ptr<Op>& op, bool fast_completion,
                            std::shared_ptr<Gate> gate) {
  worker_.register_locked(op);
  op->fast_completion = fast_completion;
  // Held back: behind its gate, or behind an earlier held post it could otherwise overtake
  // (call order is the order in which same-tag messages match). The progress thread polls it
  // from now on.
  if (gate || (!held_.empty() && must_follow_held_locked(*op))) {
    op->held = true;
    op->gate = std::move(gate);
    held_.push_back(op);
    worker_.held_changed(1);
    COMMUX_LOG(kTrace, rank_, "hold ", op->name, " ", describe(*op));
    release_held_locked();
    if (op->held) worker_.kick();
    return;
  }
  start_locked(op);
}

void Engine::start_locked(const std::shared_ptr<Op>& op) {
  // An any-source receive in parts learns its sender from part 0, then posts the rest.
  const bool later_rest =
      op->kind == Op::Kind::kRecv && op->peer == kAnySource && op->parts.size() > 1;
  op->remaining = later_rest ? 1 : static_cast<int>(op->parts.size());
  COMMUX_LOG(kTrace, rank_, "post ", op->name, " ", describe(*op));
  post_locked(op, 0, op->fast_completion);
}

namespace {
// Whether `b`, called after `a`, could match a message that `a` should (or be matched by one of
// its receiver's receives that `a`'s message should): same traffic kind, direction and tag, and
// the same peer, or for receives an any-source one on either side. Such posts keep their order.
bool ordered_after(const Op& a, const Op& b) {
  if (a.tag_kind != b.tag_kind || a.kind != b.kind || a.tag != b.tag) return false;
  return a.peer == b.peer ||
         (a.kind == Op::Kind::kRecv && (a.peer == kAnySource || b.peer == kAnySource));
}
}  // namespace

bool Engine::must_follow_held_locked(const Op& op) const {
  return std::any_of(held_.begin(), held_.end(), [&](const std::shared_ptr<Op>& h) {
    return !h->done.load() && ordered_after(*h, op);
  });
}

void Engine::release_held_locked() {
  for (std::size_t i = 0; i < held_.size() && !shut_down_ && !worker_.shut_down_locked();) {
    const std::shared_ptr<Op> op = held_[i];
    const auto drop = [&] {
      held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
      worker_.held_changed(-1);
      op->held = false;
    };
    if (op->done.load()) {  // cancelled, or failed (its peer is gone) while held
      drop();
      continue;
    }
    // Behind an earlier held post it must follow: its turn comes after that one's.
    bool behind = false;
    for (std::size_t j = 0; j < i && !behind; ++j) {
      behind = !held_[j]->done.load() && ordered_after(*held_[j], *op);
    }
    if (behind) {
      ++i;
      continue;
    }
    if (op->gate) {
      bool open = false;
      std::string failed;
      try {
        open = op->gate->open();
      } catch (const std::exception& e) {
        failed = e.what();
      } catch (...) {
        failed = "an unknown exception";
      }
      if (!failed.empty()) {
        // Loud, on this op's waits; the posts behind it go on in their order.
        const std::string what = op->gate->describe();
        drop();
        op->gate.reset();
        op->has_override = true;
        op->override_code = Errc::kTransport;
        op->override_reason = "nothing was posted: checking " + what + " failed: " + failed;
        finish_locked(*op);
        continue;
      }
      if (!open) {
        ++i;
        continue;
      }
    }
    drop();
    op->gate.reset();
    start_locked(op);
  }
}

void Engine::post_locked(const std::shared_ptr<Op>& op, std::size_t first_part,
                         bool fast_completion) {
  const bool later_rest = op->kind == Op::Kind::kRecv && op->peer == kAnySource &&
                          first_part == 0 && op->parts.size() > 1;
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
    for (auto& d : ready) {
      if (!d->parked) {
        post_locked(d, 1, false);
        continue;
      }
      // Failed before the rest was posted: those parts never go to UCX.
      d->remaining -= static_cast<int>(d->parts.size()) - 1;
      if (d->remaining == 0) unpark_locked(*d);
    }
    auto cancel = std::move(to_cancel_);
    to_cancel_.clear();
    for (auto& op : cancel) op->cancel_parts_locked(worker_.handle());
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
  // UCX may complete the part inside the call, through the callback (a receive that matches a
  // message already there: UCP_OP_ATTR_FLAG_NO_IMM_CMPL), and still return the request, which the
  // callback has released by then. The callbacks clear `posting`: the returned request is kept as
  // the part's request in UCX only if it is still set after the call.
  part.posting = true;
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
    r = ucp_tag_send_nbx(peers_[op.peer].ep, buf, cnt, make_tag(f).bits, &prm);
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
    r = ucp_tag_recv_nbx(worker_.handle(), buf, cnt, m.tag.bits, m.mask.bits, &prm);
  }
  const bool completed_in_call = !part.posting;
  part.posting = false;
  if (UCS_PTR_IS_ERR(r)) {
    const bool filled = op.kind == Op::Kind::kRecv && part.info.length != kNoInfo;
    part_done_locked(op, part.index, UCS_PTR_STATUS(r), filled ? &part.info : nullptr);
  } else if (r == nullptr) {
    part_done_locked(op, part.index, UCS_OK, op.kind == Op::Kind::kRecv ? &part.info : nullptr);
  } else if (!completed_in_call) {
    part.ucx_req = r;
  }
}

// A small send that UCX finishes inside the call (its short protocol: the bytes are in the
// transport when it returns) needs no Op: no allocation, no registration, no completion to wait
// for. UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL makes UCX send nothing unless it can finish it so.
// (Receives have no such path: with that flag UCX drops a matched message that is not a single
// eager fragment.) Anything else returns false with nothing sent, and post() does it the full way,
// errors included, in the same order: a send held back (post_after) is never overtaken.
bool Engine::inside_call_fits(const Buffer& b, int peer) const noexcept {
  // (Traced messages go the logged way.)
  return b.mem == MemoryType::kHost && peer >= 0 && peer < size_ &&
         (b.data != nullptr || b.size == 0) && !log::enabled(log::Level::kTrace);
}

bool Engine::inside_call_allowed_locked(int peer, TagKind kind) const {
  const Peer& p = peers_[peer];
  return !shut_down_ && !worker_.shut_down_locked() && held_.empty() && p.status == UCS_OK &&
         p.ep != nullptr && (kind != TagKind::kInternal || peers_.group_broken_locked() < 0);
}

bool Engine::send_now(const Buffer& b, int peer, TagKind kind, std::uint32_t tag) {
  if (b.size > kSendNowCeiling || !inside_call_fits(b, peer)) return false;
  std::lock_guard<std::mutex> lock(worker_.mutex());
  Peer& to = peers_[peer];
  if (b.size > to.send_now_max || !inside_call_allowed_locked(peer, kind)) return false;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.memory_type = UCS_MEMORY_TYPE_HOST;
  TagFields f;
  f.sender = rank_;
  f.group = options_.group;
  f.kind = kind;
  f.user = tag;
  const ucs_status_ptr_t r = ucp_tag_send_nbx(to.ep, b.data, b.size, make_tag(f).bits, &prm);
  if (r == nullptr) return true;
  if (UCS_PTR_IS_ERR(r)) {  // nothing sent
    if (UCS_PTR_STATUS(r) == UCS_ERR_NO_RESOURCE && b.size > kSendNowFloor) {
      to.send_now_max = b.size - 1;  // (a post costs more after a failed try)
    }
    return false;
  }
  // UCX took the message after all (it does not, with this flag): it is in flight, so it is not
  // posted again; wait for it here, as post() and a wait would.
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  while (ucp_request_check_status(r) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < deadline) {
    progress_locked();
  }
  ucs_status_t st = ucp_request_check_status(r);
  if (st == UCS_INPROGRESS) {
    ucp_request_cancel(worker_.handle(), r);
    st = UCS_ERR_TIMED_OUT;
  }
  ucp_request_free(r);
  if (st != UCS_OK) {
    throw error_from_status(st,
                            ErrorSite{"send", peer, tag, b.size, std::to_string(options_.group)},
                            "to peer " + std::to_string(peer) + ", tag " + std::to_string(tag) +
                                ", " + std::to_string(b.size) + " bytes (sent inside the call)");
  }
  return true;
}

// A receive whose message is there already needs no Op: ucp_tag_probe_nb takes it from UCX's
// unexpected queue with its sender tag and length, and ucp_tag_msg_recv_nbx copies it out inside
// the call (an eager message). One that is not there yet is posted as post() would, in the same
// call. The rare message found that UCX cannot finish inside the call (a rendezvous, or an eager
// one whose fragments are still arriving) becomes an Op as the call returns: UCX keeps the
// receive, and its callback (adopted_recv_cb, user data the Engine, as the Op did not exist at
// the call) finds the Op's Part by its request. A message that does not fit (too long, packed
// differently) becomes a finished Op, with the error, length included, that post() would give.
bool Engine::recv_now(const char* name, const Buffer& b, int peer, TagKind kind, std::uint32_t tag,
                      std::size_t* bytes, Request* posted) {
  if (!inside_call_fits(b, peer)) return false;
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (!inside_call_allowed_locked(peer, kind)) return false;
  const RecvMatch m = recv_match(peer, options_.group, kind, false, tag);
  ucp_tag_recv_info_t info{};
  const ucp_tag_message_h msg =
      ucp_tag_probe_nb(worker_.handle(), m.tag.bits, m.mask.bits, 1, &info);
  std::shared_ptr<Op> op = nullptr;
  if (msg == nullptr) {  // not there yet: posted now, in this call, as post() would
    op = make_op(Op::Kind::kRecv, name, &b, 1, peer, kind, tag);
    enqueue_locked(op, false, nullptr);
    *posted = make_request(std::move(op));
    return false;
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.cb.recv = &Engine::adopted_recv_cb;
  prm.user_data = this;
  prm.memory_type = UCS_MEMORY_TYPE_HOST;
  adopted_.reserve(adopted_.size() + 1);  // (so listing the receive below cannot throw)
  InlineRecv in_call;
  inline_recv_ = &in_call;
  const ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker_.handle(), b.data, b.size, msg, &prm);
  inline_recv_ = nullptr;
  // Finished inside the call: returned as a status, or (the request released) by the callback.
  const bool finished = r == nullptr || UCS_PTR_IS_ERR(r) || in_call.done;
  const ucs_status_t st =
      in_call.done ? in_call.status : (r == nullptr ? UCS_OK : UCS_PTR_STATUS(r));
  if (finished && st == UCS_OK && info.length <= b.size &&
      (info.sender_tag & tag_layout::kIovBit) == 0) {
    *bytes = info.length;
    return true;
  }
  op = make_op(Op::Kind::kRecv, name, &b, 1, peer, kind, tag);
  worker_.register_locked(op);
  op->remaining = 1;
  if (!finished) {
    op->parts[0].ucx_req = r;
    adopted_.emplace_back(r, &op->parts[0]);
  } else {
    part_done_locked(*op, 0, st, &info);
  }
  *posted = make_request(std::move(op));
  return false;
}

// ---------------------------------------------------------------------------------------------
// Completion (runs inside ucp_worker_progress or inline after posting; worker mutex held)

void Engine::send_cb(void* request, ucs_status_t status, void* user_data) {
  auto* part = static_cast<Part*>(user_data);
  Op* op = part->op;
  part->ucx_req = nullptr;
  part->posting = false;
  ucp_request_free(request);
  op->engine->part_done_locked(*op, part->index, status, nullptr);
}

void Engine::recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data) {
  auto* part = static_cast<Part*>(user_data);
  Op* op = part->op;
  part->ucx_req = nullptr;
  part->posting = false;
  const ucp_tag_recv_info_t copy = info != nullptr ? *info : ucp_tag_recv_info_t{};
  ucp_request_free(request);
  op->engine->part_done_locked(*op, part->index, status, info != nullptr ? &copy : nullptr);
}

void Engine::adopted_recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                             void* user_data) {
  auto* e = static_cast<Engine*>(user_data);
  const auto it = std::find_if(e->adopted_.begin(), e->adopted_.end(),
                               [&](const auto& a) { return a.first == request; });
  if (it == e->adopted_.end()) {
    ucp_request_free(request);
    if (e->inline_recv_ != nullptr && !e->inline_recv_->done) {  // inside recv_now's call
      e->inline_recv_->done = true;
      e->inline_recv_->status = status;
      return;
    }
    // (Cannot happen: recv_now lists a receive UCX keeps before UCX can call this.)
    COMMUX_LOG(kWarn, e->rank_, "a receive UCX completed is not listed: ignored");
    return;
  }
  Part* part = it->second;
  *it = e->adopted_.back();
  e->adopted_.pop_back();
  recv_cb(request, status, info, part);
}

void Engine::part_done_locked(Op& op, std::uint32_t index, ucs_status_t status,
                              const ucp_tag_recv_info_t* info) {
  if (op.parked) {  // already failed and reported: only UCX's hold on it ends
    if (--op.remaining == 0) unpark_locked(op);
    return;
  }
  if (op.kind == Op::Kind::kRecv) {
    if (info != nullptr && (status == UCS_OK || status == UCS_ERR_MESSAGE_TRUNCATED)) {
      const TagFields f = parse_tag(TagValue{info->sender_tag});
      if (index == 0) op.source = f.sender;
      const std::size_t posted = op.packing == Packing::kIov
                                     ? op.capacity
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
  // A transport error from a peer that has died is that peer's failure: say so (UCX may see it
  // before the process check does; fail_locked is safe inside UCX's callbacks).
  const int with = op.peer != kAnySource ? op.peer : op.source;
  if (!op.has_override && op.status != UCS_OK && op.status != UCS_ERR_CANCELED &&
      op.status != UCS_ERR_MESSAGE_TRUNCATED && with >= 0 &&
      peers_.check_gone_locked(with, op.status)) {
    op.has_override = true;
    op.override_code = Errc::kPeerFailed;
    op.override_reason = peers_.gone(with);
  }
  if (op.has_override) {
    op.error = std::make_exception_ptr(
        Error(op.override_code,
              ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)},
              op.override_reason + " (" + describe(op) + ")"));
  } else if (op.status == UCS_ERR_MESSAGE_TRUNCATED) {
    op.error = std::make_exception_ptr(Error(
        Errc::kTruncated,
        ErrorSite{op.name, op.source, op.tag, op.capacity, std::to_string(options_.group)},
        "message from peer " + std::to_string(op.source) + " with tag " + std::to_string(op.tag) +
            " is too long: " + op.detail + " (" + describe(op) + ")"));
  } else if (op.status != UCS_OK) {
    op.error = std::make_exception_ptr(error_from_status(
        op.status, ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)},
        describe(op)));
  }
  COMMUX_LOG(kTrace, rank_, "done ", op.name, " ", describe(op), ": ", op.bytes, " bytes moved",
             op.kind == Op::Kind::kRecv ? log::cat(" from ", op.source) : std::string(),
             op.error ? " (failed)" : "");
  const std::shared_ptr<Op> keep =
      worker_.unregister_locked(op);  // keeps op alive to the end of this
  op.done.store(true);
  worker_.notify_done();
}

void Engine::fail_op_locked(Op& op, Errc code, const std::string& reason, bool linger) {
  if (op.done.load()) return;
  if (op.held) {  // UCX never had it: finished at once (release_held_locked drops it)
    op.has_override = true;
    op.override_code = code;
    op.override_reason = reason;
    finish_locked(op);
    return;
  }
  const bool lingering = op.lingering_since != std::chrono::steady_clock::time_point{};
  if (linger && lingering) return;           // cancelled already
  const std::shared_ptr<Op> keep = op.self;  // cancelling may finish it
  if (!op.has_override) {
    op.has_override = true;
    op.override_code = code;
    op.override_reason = reason;
  }
  // UCX completes a receive it has not matched yet at once (UCS_ERR_CANCELED, inside the call).
  if (!lingering) op.cancel_parts_locked(worker_.handle());
  if (op.done.load()) return;
  if (linger) {
    op.lingering_since = std::chrono::steady_clock::now();
    return;
  }
  // What UCX still holds: a send to a peer that is gone (UCX does not complete a shared-memory
  // rendezvous whose receiver died), or one a live receiver will no longer match; a receive from
  // a dead peer that UCX had matched (the peer can write nothing more, and progress was idle, so
  // nothing it sent before is left to copy in). The Op is finished now and parked until UCX
  // completes its parts (at the latest when the endpoints are closed at shutdown).
  op.parked = true;
  parked_.push_back(keep);
  finish_locked(op);
}

void Engine::abandon_locked(Op& op) {
  if (op.done.load() || op.abandoned.load()) return;
  op.abandoned.store(true);
  worker_.notify_done();
}

void Engine::unpark_locked(Op& op) {
  const auto it = std::find_if(parked_.begin(), parked_.end(),
                               [&](const std::shared_ptr<Op>& p) { return p.get() == &op; });
  if (it == parked_.end()) return;
  std::shared_ptr<Op> keep = std::move(*it);  // released after the erase, not during it
  parked_.erase(it);
}

Request Engine::post(Direction dir, const char* name, const Buffer* buffers, std::size_t count,
                     int peer, TagKind kind, std::uint32_t tag, bool fast_completion) {
  return make_request(post_op(dir == Direction::kSend ? Op::Kind::kSend : Op::Kind::kRecv, name,
                              buffers, count, peer, kind, tag, fast_completion));
}

Request Engine::post_after(std::shared_ptr<Gate> gate, Direction dir, const char* name,
                           const Buffer* buffers, std::size_t count, int peer, TagKind kind,
                           std::uint32_t tag, bool fast_completion) {
  return make_request(post_op(dir == Direction::kSend ? Op::Kind::kSend : Op::Kind::kRecv, name,
                              buffers, count, peer, kind, tag, fast_completion, std::move(gate)));
}

bool Op::test() { return engine->test(*this); }
void Op::wait_for(std::chrono::milliseconds timeout) { engine->wait(*this, timeout); }
bool Op::await(std::chrono::milliseconds timeout, bool spin, bool goes_on) {
  return engine->await(*this, timeout, spin, goes_on);
}
void Op::request_cancel() { engine->cancel(*this); }
std::chrono::milliseconds Op::default_timeout() const noexcept { return engine->options().timeout; }

bool Engine::test(Op& op) {
  if (op.done.load()) return true;
  std::unique_lock<std::mutex> lock(worker_.mutex(), std::try_to_lock);
  if (lock.owns_lock()) progress_locked();
  return op.done.load();
}

void Engine::wait(Op& op, std::chrono::milliseconds timeout) {
  const bool ended = worker_.wait(op, timeout, options_.spin);
  if (ended && op.done.load()) return;
  std::string d;
  {
    std::lock_guard<std::mutex> lock(worker_.mutex());
    d = describe(op);
    if (ended) {  // abandoned: its peer failure, while UCX still holds it (Request adds "posted")
      throw Error(op.override_code,
                  ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)},
                  op.override_reason + " (" + d + ")");
    }
  }
  throw Error(Errc::kTimeout,
              ErrorSite{op.name, op.peer, op.tag, op.capacity, std::to_string(options_.group)},
              "Timed out after " + std::to_string(timeout.count()) + " ms (" + d + ")");
}

// A waiter that goes on progressing keeps the other transfers in flight to itself where the
// ranks on this host have a CPU each and none to spare (the progress thread would take one from
// a rank), and hands them back once it stops (hand_back()). With CPUs to spare the progress
// thread moves them meanwhile on a CPU of its own; where the ranks outnumber the CPUs, a rank's
// caller is often off its CPU in the middle of a call, and its progress thread moves them then
// (4 ranks on 2 CPUs, 64 KiB allreduce: 1.19-1.24x the time when they were kept).
bool Engine::await(Op& op, std::chrono::milliseconds timeout, bool spin, bool goes_on) {
  return worker_.wait(op, timeout, spin ? options_.spin : std::chrono::microseconds(-1),
                      /*hand_back=*/!goes_on || !keep_progress_);
}

void Engine::hand_back() noexcept {
  if (keep_progress_) worker_.hand_back();
}

std::pair<std::uint64_t, std::uint64_t> Engine::probe_match(TagKind kind, std::uint32_t value,
                                                            std::uint32_t mask) const {
  TagFields f;
  f.group = options_.group;
  f.kind = kind;
  f.user = value & mask;
  const std::uint64_t tag = make_tag(f).bits;
  const std::uint64_t tmask = ~(tag_layout::kRankMask | tag_layout::kIovBit |
                                tag_layout::kContinuationBit | (tag_layout::kUserMask & ~mask));
  return {tag, tmask};
}

bool Engine::probe(TagKind kind, int sender, std::uint32_t value, std::uint32_t mask,
                   Unexpected* out) {
  auto [tag, tmask] = probe_match(kind, value, mask);
  if (sender >= 0 && sender < tag_layout::kMaxRanks) {
    tag |= static_cast<std::uint64_t>(sender) << tag_layout::kRankShift;
    tmask |= tag_layout::kRankMask;
  }
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (worker_.handle() == nullptr || worker_.shut_down_locked()) return false;
  progress_locked();
  ucp_tag_recv_info_t info{};
  if (ucp_tag_probe_nb(worker_.handle(), tag, tmask, 0, &info) == nullptr) return false;
  if (out != nullptr) {
    const TagFields g = parse_tag(TagValue{info.sender_tag});
    out->sender = g.sender;
    out->tag = g.user;
    out->bytes = info.length;
  }
  return true;
}

namespace {
// A dropped message's receive: nothing to free but UCX's request.
void discard_done(void* request, ucs_status_t /*status*/, const ucp_tag_recv_info_t* /*info*/,
                  void* /*user_data*/) {
  if (request != nullptr) ucp_request_free(request);
}
}  // namespace

std::size_t Engine::discard(TagKind kind, std::uint32_t value, std::uint32_t mask) {
  const auto [tag, tmask] = probe_match(kind, value, mask);
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (worker_.handle() == nullptr || worker_.shut_down_locked()) return 0;
  // No progress call: this runs before every collective while a failed call's leftovers may
  // still come, and what has not arrived yet is dropped by a later call.
  //
  // Each message is taken by a receive of zero bytes, which UCX fails as truncated without
  // fetching anything: a rendezvous sender is released without its buffer being read. Its call
  // failed, so it may have freed that buffer already (cancel() cannot take back a send whose
  // announcement the peer holds); a full-size receive had UCX copy from it.
  static char sink = 0;
  std::size_t n = 0;
  for (;;) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker_.handle(), tag, tmask, 1, &info);
    if (msg == nullptr) break;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    prm.cb.recv = discard_done;
    static_cast<void>(ucp_tag_msg_recv_nbx(worker_.handle(), &sink, 0, msg, &prm));
    ++n;
  }
  return n;
}

void Engine::cancel(Op& op) {
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (op.done.load() || shut_down_ || worker_.shut_down_locked()) return;
  if (op.held) {  // never posted: cancelled now
    op.status = UCS_ERR_CANCELED;
    finish_locked(op);
    return;
  }
  op.cancel_parts_locked(worker_.handle());
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
  if (op.held) {
    s += "; not posted yet: waiting for " +
         (op.gate ? op.gate->describe() : std::string("an earlier post held back before it"));
  }
  return s;
}

}  // namespace commux::detail
