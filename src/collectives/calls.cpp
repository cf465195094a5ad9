// Cross-rank call checks: fingerprints in the tags, and notices.
//
// Every message of a collective call carries, in the user field of its tag, the low 16 bits of
// the call's tag (Context::tag) and a 16-bit fingerprint of the call (CallId and
// Context::call_key). Two ranks in different calls with the same tag (one rank broadcasts while
// the other reduces; the sizes, data types, roots, reduce ops or algorithms differ) therefore
// never pair their messages. What they do instead:
//   * a waiting rank looks, every few milliseconds, for a message from the peer it waits on whose
//     tag has this call's slot (the low 16 bits) but another fingerprint: the peer is in a
//     different call. It fails, and first sends a notice (TagKind::kNotice, the call's full tag)
//     describing its own call to every other rank;
//   * a waiting rank also looks for a notice about its call from any rank: that rank rejected the
//     call (reject(): bad arguments, before posting anything) or found the mismatch. It fails with
//     both calls named, and passes its own notice on, so that every rank of the call fails instead
//     of waiting for one that has given up.
// A notice's payload is one kind byte ('R' rejected, 'M' in a different call), the sender's
// description of its call ("broadcast #7 (1000 float32 from root 0)"), a newline, and the reason.
// A third kind, 'S' (say_shutdown), has no call: its sender shut its collectives down, and its tag
// is that of the first call it never made. It is sent after everything else the rank sent, so a
// rank that has received every peer's 'S' has received every notice the peers will ever send it
// (UCX matches the messages of one endpoint in the order they were sent).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "../core/channel.hpp"
#include "algo.hpp"

namespace commux::coll {

namespace {

constexpr std::uint32_t kSlotMask = 0xFFFF;                 // the tag's slot in the user field
constexpr std::size_t kMaxNotice = 4096;                    // longer notices are cut
constexpr std::chrono::milliseconds kPeerNoticeWait{1000};  // for the peer's own description

std::uint64_t mix(std::uint64_t h, std::uint64_t v) noexcept {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

std::uint16_t fold16(std::uint64_t h) noexcept {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return static_cast<std::uint16_t>(h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48));
}

std::string call_name(const Context& ctx) {
  const char* op = ctx.op_name != nullptr && *ctx.op_name != '\0' ? ctx.op_name : "collective";
  return std::string(op) + " #" + std::to_string(ctx.tag);
}

// Sends `payload` as a notice about call ctx.tag to every other rank; never waits or throws.
void send_notices(const Context& ctx, const std::string& payload) noexcept {
  if (ctx.comm == nullptr) return;
  try {
    ::commux::detail::Channel& chan = ::commux::detail::channel(*ctx.comm);
    const std::size_t len = std::min(payload.size(), kMaxNotice);
    for (int p = 0; p < chan.size(); ++p) {
      if (p == chan.rank()) continue;
      try {
        std::unique_ptr<char[]> data(new char[len + 1]);
        std::memcpy(data.get(), payload.data(), len);
        const Buffer b{data.get(), len, MemoryType::kHost};
        detail::park(chan.post_send(&b, 1, p, TagKind::kNotice, ctx.tag, true), std::move(data));
      } catch (...) {
        // a peer that is gone or a channel shut down: the others still get theirs
      }
    }
  } catch (...) {
  }
}

}  // namespace

std::uint32_t call_wire_tag(std::uint32_t tag, std::uint64_t fingerprint) noexcept {
  return (tag & kSlotMask) | (static_cast<std::uint32_t>(fold16(fingerprint)) << 16);
}

void reject(const Context& ctx, const std::string& reason) noexcept {
  try {
    send_notices(ctx, "R" + call_name(ctx) + "\n" + reason);
  } catch (...) {
  }
}

void say_shutdown(const Context& ctx) noexcept { send_notices(ctx, "S\n"); }

std::size_t discard_call(const Context& ctx) {
  if (ctx.comm == nullptr) return 0;
  ::commux::detail::Channel& chan = ::commux::detail::channel(*ctx.comm);
  return chan.discard(TagKind::kInternal, ctx.tag, kSlotMask) +
         chan.discard(TagKind::kNotice, ctx.tag, ~std::uint32_t{0});
}

namespace detail {

std::uint64_t hash_sizes(const std::size_t* v, std::size_t n) noexcept {
  std::uint64_t h = n;
  for (std::size_t i = 0; i < n; ++i) h = mix(h, v[i]);
  return h;
}

void Exchange::identify(const CallId& id) {
  id_ = id;
  std::uint64_t h = mix(static_cast<std::uint64_t>(id.coll) + 1, id.algo_index);
  h = mix(h, id.count);
  h = mix(h, static_cast<std::uint64_t>(id.dtype + 1));
  h = mix(h, static_cast<std::uint64_t>(id.op + 1));
  h = mix(h, static_cast<std::uint64_t>(id.root + 1));
  h = mix(h, id.bytes);
  h = mix(h, id.extra);
  if (id.device_pipeline) h = mix(h, 1);  // (host calls keep the fingerprint they had)
  h = mix(h, ctx_.call_key);
  wire_ = call_wire_tag(ctx_.tag, h);
}

std::string Exchange::describe_call() const {
  const auto coll = static_cast<Coll>(id_.coll);
  std::string text;
  if (ctx_.call_text != nullptr && *ctx_.call_text != '\0') {
    text = ctx_.call_text;
  } else if (id_.count > 0 || id_.dtype >= 0) {
    text = std::to_string(id_.count) + " " + dtype_name(static_cast<DataType>(id_.dtype));
  } else if (coll == Coll::kAllgather && id_.uneven) {
    text = "parts of different sizes";
  } else if (coll == Coll::kAllgather || coll == Coll::kGather || coll == Coll::kScatter) {
    text = std::to_string(id_.bytes) + " bytes per rank";
  } else if (coll == Coll::kBroadcast) {
    text = std::to_string(id_.bytes) + " bytes";
  }
  auto add = [&](const std::string& part) { text += (text.empty() ? "" : " ") + part; };
  if (id_.op >= 0) add(reduce_op_name(static_cast<ReduceOp>(id_.op)));
  if (id_.root >= 0) {
    add(std::string(coll == Coll::kBroadcast || coll == Coll::kScatter ? "from" : "to") + " root " +
        std::to_string(id_.root));
  }
  if (id_.algo != nullptr && *id_.algo != '\0') {
    text += std::string(text.empty() ? "" : ", ") + id_.algo;
  }
  // A large reduction is cut by its memory class (internal.hpp): named, so that ranks in device
  // and in host memory see why their calls differ.
  if (id_.device_pipeline) text += std::string(text.empty() ? "" : ", ") + "in device memory";
  return call_name(ctx_) + (text.empty() ? "" : " (" + text + ")");
}

void Exchange::notify(char kind, const std::string& reason) {
  if (notified_) return;
  notified_ = true;
  send_notices(ctx_, std::string(1, kind) + describe_call() + "\n" + reason);
}

namespace {

// Receives the notice `u` (it has arrived: the receive completes at once).
std::string take_notice(::commux::detail::Channel& chan, const ::commux::detail::Unexpected& u,
                        std::uint32_t tag) {
  std::string text(std::min(u.bytes, kMaxNotice), '\0');
  const Buffer b{text.data(), text.size(), MemoryType::kHost};
  try {
    Request r = chan.post_recv(&b, 1, u.sender, TagKind::kNotice, tag);
    r.wait(std::chrono::milliseconds(1000));
    text.resize(std::min(r.bytes(), text.size()));
  } catch (...) {
    return "";
  }
  return text;
}

}  // namespace

// A notice's parts: "<kind><the call as its sender describes it>\n<reason>" (kind R: it rejected
// the call; M: it found the calls disagreeing, or stopped it).
struct NoticeText {
  char kind;
  std::string what, reason;
};
NoticeText split_notice(const std::string& notice) {
  const std::size_t nl = notice.find('\n');
  return {notice.empty() ? '?' : notice[0],
          notice.empty() ? "" : notice.substr(1, nl == std::string::npos ? nl : nl - 1),
          nl == std::string::npos ? "" : notice.substr(nl + 1)};
}

void Exchange::check_calls(std::size_t id) {
  ::commux::detail::Unexpected u;
  if (chan_->probe(TagKind::kNotice, kAnySource, ctx_.tag, ~std::uint32_t{0}, &u)) {
    noticed(u.sender, take_notice(*chan_, u, ctx_.tag));
  }
  const Request& r = reqs_[id].req;
  const int peer = r.valid() ? ::commux::detail::state_of(r)->posted_peer() : -1;
  if (peer < 0 || peer == rank_) return;
  // From that peer only: its messages of this slot all belong to one call of its, whereas the
  // first of any sender's could be a message of this call that waits for a receive posted later.
  if (chan_->probe(TagKind::kInternal, peer, wire_, kSlotMask, &u) && u.tag != wire_) {
    mismatch(u.sender);
  }
}

void Exchange::poll_caller() {
  try {
    ctx_.poll();
  } catch (...) {
    // Not an Error: it leaves unchanged (the destructor cancels what is outstanding).
    notify('M', "its caller stopped the call on that rank (e.g. Ctrl-C)");
    throw;
  }
}

void Exchange::noticed(int peer, const std::string& notice) {
  const auto [kind, what, reason] = split_notice(notice);
  const std::string mine = describe_call();
  std::string msg;
  if (kind == 'S') {
    msg = "rank " + std::to_string(peer) +
          " shut down the process group without making this call; this rank is in " + mine;
  } else if (kind == 'R') {
    msg = "rank " + std::to_string(peer) + " rejected its call " + what + ": " + reason +
          "; this rank is in " + mine;
  } else {
    msg = "rank " + std::to_string(peer) + " is in " + (what.empty() ? "a different call" : what) +
          (reason.empty() ? "" : " (" + reason + ")") + ", this rank is in " + mine;
  }
  // Pass it on: ranks still waiting for this one learn that the call is over.
  notify('M', "rank " + std::to_string(peer) + " stopped the call");
  fail(Errc::kCallMismatch, msg);
}

void Exchange::mismatch(int peer) {
  notify('M', "it received a message of a different call from rank " + std::to_string(peer));
  // The peer finds this rank's messages just as this rank found its: wait briefly for its notice,
  // so the error can name its call.
  const auto until = Clock::now() + std::min(kPeerNoticeWait, remaining());
  ::commux::detail::Unexpected u;
  while (Clock::now() < until) {
    if (chan_->probe(TagKind::kNotice, peer, ctx_.tag, ~std::uint32_t{0}, &u)) {
      noticed(peer, take_notice(*chan_, u, ctx_.tag));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  fail(Errc::kCallMismatch, "rank " + std::to_string(peer) +
                                " sent a message of a different call with this call's tag; this "
                                "rank is in " +
                                describe_call());
}

}  // namespace detail

bool find_notice(const Context& ctx, std::uint32_t* call, int* sender, int from) {
  if (ctx.comm == nullptr) return false;
  ::commux::detail::Unexpected u{};
  if (!::commux::detail::channel(*ctx.comm).probe(TagKind::kNotice, from, 0, 0, &u)) {
    return false;
  }
  *call = u.tag;  // a notice's user field is its call's tag
  *sender = u.sender;
  return true;
}

char take_notice(const Context& ctx, int sender, std::string* what, std::string* reason) {
  if (ctx.comm == nullptr) return '\0';
  ::commux::detail::Channel& chan = ::commux::detail::channel(*ctx.comm);
  ::commux::detail::Unexpected u{};
  std::string text;
  if (chan.probe(TagKind::kNotice, sender, ctx.tag, ~std::uint32_t{0}, &u)) {
    text = detail::take_notice(chan, u, ctx.tag);
  }
  detail::NoticeText n = detail::split_notice(text);
  // (Every rank that shuts down says so with the same tag: the others' are left for their turn.)
  if (n.kind != 'S') discard_call(ctx);
  *what = std::move(n.what);
  *reason = std::move(n.reason);
  return text.empty() ? '\0' : n.kind;
}

}  // namespace commux::coll
