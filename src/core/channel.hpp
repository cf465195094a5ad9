// The internal channel: tagged point-to-point with a traffic kind, for the layers above core.
//
// Not installed. The public commux::Communicator offers user-tag operations only (its tags are
// checked and always carry TagKind::kUser), so user traffic can never match a collective's
// message (see commux/tag.hpp). The collectives (src/collectives) and the torch adapter
// (src/c10d) post their own traffic through this channel instead: detail::channel(comm).
//
// Implementations:
//   * the UCX engine (src/core/engine.hpp), behind every Communicator a user constructs;
//   * test channels (tests/loopback_channel.hpp): in-process worlds of threads-as-ranks that run
//     the real collective code without UCX, record what each rank posts and waits for, and report
//     a deadlock instead of hanging.
// A Communicator can be made over any Channel (communicator_over), so everything written against
// the public API runs over a test channel as well.
//
// Requests: a Request is a handle onto a RequestState, which the channel that posted it owns and
// completes. All methods are thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "commux/communicator.hpp"
#include "commux/tag.hpp"

namespace commux::detail {

enum class Direction : std::uint8_t { kSend, kRecv };

// A message that arrived and matched no receive yet (Channel::probe).
struct Unexpected {
  int sender = -1;
  std::uint32_t tag = 0;  // the user field of its tag
  std::size_t bytes = 0;
};

// One posted operation, as Request sees it.
class RequestState {
 public:
  virtual ~RequestState() = default;
  // Drives progress once; true once finished (successfully or not).
  virtual bool test() = 0;
  // Returns once finished; throws Error(kTimeout, ...) naming the operation if it is not finished
  // after `timeout` (the operation then stays posted). Never throws the operation's own failure.
  virtual void wait_for(std::chrono::milliseconds timeout) = 0;
  // Returns whether the operation finished within `timeout` (false: it stays posted). Never
  // throws for a timeout or the operation's failure; `spin` false: sleep at once (a waiter that
  // already spun for this operation). `goes_on`: the waiter progresses the channel again right
  // after (a driver of schedules resumes the call it waited for), so it does not hand the
  // progress of other transfers in flight to a background thread when this one finishes.
  virtual bool await(std::chrono::milliseconds timeout, bool spin, bool goes_on) = 0;
  // Asks the channel to cancel; the operation then finishes with kCanceled unless it matched.
  virtual void request_cancel() = 0;
  virtual bool finished() const noexcept = 0;
  virtual int posted_peer() const noexcept = 0;  // as posted (kAnySource possible)
  // Readable once finished():
  virtual int sender() const noexcept = 0;  // the real sender of a receive; a send's peer
  virtual std::size_t transferred() const noexcept = 0;
  virtual std::exception_ptr failure() const noexcept = 0;
  // The poster's default wait deadline (Options::timeout of its channel).
  virtual std::chrono::milliseconds default_timeout() const noexcept = 0;
};

// A condition a post waits for before it reaches the transport: in the torch adapter, the
// events recorded on a device tensor's streams (the kernels that write the tensor must be done
// before UCX reads it). Polled, never blocked on, by whoever progresses the channel.
class Gate {
 public:
  virtual ~Gate() = default;
  // Whether the post may go now. Must not block; called with the channel's lock held, from any
  // thread. An exception fails the post with its message (a device error, say).
  virtual bool open() = 0;
  // What the post waits for, for errors and timeouts ("the work queued on cuda:0's stream").
  virtual std::string describe() const = 0;
};

// Work of a layer above core that the channel's progress thread does between its progress calls
// (the torch adapter resumes its suspended collectives there, so that a collective nobody waits
// for advances without a thread of its own).
class Driver {
 public:
  virtual ~Driver() = default;
  // Called on the progress thread after each progress call while no user thread is spinning,
  // without the channel's lock. Must not block: a wait it makes on a request of the channel
  // progresses the channel itself (it never sleeps on the progress thread's work), but a wait on
  // anything else would stall every sleeping waiter of the process. Must not throw. Returns
  // whether it has work listed that waits for the channel's requests (the progress thread then
  // polls without sleeping for a while after each completion, as a waiter spins).
  virtual bool drive() noexcept = 0;
};

class Channel {
 public:
  virtual ~Channel() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual const Options& options() const noexcept = 0;
  virtual const RuntimeInfo& info() const noexcept = 0;
  // Whether the process's affinity mask has more CPUs than the group has ranks on this host
  // (known once the communicator has connected): a thread of a rank's beyond its caller's can
  // then run without taking a CPU from a rank. The default says yes.
  virtual bool spare_cpus() const noexcept { return true; }
  // A caller that waited with RequestState::await's `goes_on` has stopped progressing the channel
  // (a collective call's end): whatever other transfers are still in flight move on in the
  // background from now on. Never blocks or throws.
  virtual void hand_back() noexcept {}
  // Posts one logical operation over `count` buffers. `name` ("isend", "send", ...) names it in
  // errors. fast_completion (sends): ask for local completion as early as the transport allows.
  // Validation errors (peer, buffers) throw Error(kInvalidArgument) before anything is posted.
  virtual Request post(Direction dir, const char* name, const Buffer* buffers, std::size_t count,
                       int peer, TagKind kind, std::uint32_t tag, bool fast_completion) = 0;
  // post(), held back until `gate` opens, returning at once. A later post that could otherwise
  // overtake it in matching (same traffic kind, direction, tag and peer; for receives, an
  // any-source one against any peer), gated or not, goes to the transport after it, so same-tag
  // messages match in the order of the calls; other posts are not held up. A wait on the
  // Request (or any progress) posts it once the gate is open; a timeout names what it waits for.
  // Validation errors throw at once, as post()'s do. The default waits for the gate on the
  // calling thread (polling it until options().timeout), then posts: correct, not asynchronous.
  virtual Request post_after(std::shared_ptr<Gate> gate, Direction dir, const char* name,
                             const Buffer* buffers, std::size_t count, int peer, TagKind kind,
                             std::uint32_t tag, bool fast_completion);
  // Looks, without receiving it, for a message of traffic `kind` from `sender` (kAnySource: any)
  // that arrived and matched no receive, whose tag's user field equals `value` on the bits of
  // `mask` (the first such, in arrival order). For the cross-rank call checks of the collectives.
  virtual bool probe(TagKind kind, int sender, std::uint32_t value, std::uint32_t mask,
                     Unexpected* out) = 0;
  // Receives and drops every such message (those of a call that failed or was rejected, which
  // would otherwise wait in the transport for a receive that never comes); returns how many.
  virtual std::size_t discard(TagKind kind, std::uint32_t value, std::uint32_t mask) = 0;
  // Cancels what is posted and releases the transport; bounded by options().shutdown_timeout.
  // Safe to call twice.
  virtual void shutdown() = 0;
  // Has the channel's progress thread call `driver` (nullptr: no driver). Returns false when the
  // channel has no progress thread, or has shut down (the caller must then drive its work
  // itself). A driver set
  // stays until replaced, or until shutdown(); replacing it returns once no call of the old
  // one is running, unless made from inside that call.
  virtual bool set_driver(std::shared_ptr<Driver> driver) {
    (void)driver;
    return false;
  }
  // Wakes the progress thread, so that it calls the driver soon (work the driver can start).
  virtual void wake_driver() noexcept {}
  // How many times the progress thread has taken the channel's lock to progress it (0 without
  // one): for the tests, and to see how much of the progress it does.
  virtual std::uint64_t progress_thread_passes() const noexcept { return 0; }
  // For the tests: how much longer the progress thread's present sleep lasts (zero while it is
  // awake, or without one), and how many threads sleep in a wait.
  virtual std::chrono::microseconds progress_thread_nap_left() const noexcept {
    return std::chrono::microseconds(0);
  }
  virtual int sleeping_waiters() const noexcept { return 0; }

  // Sends one buffer if the transport can finish it inside this call (a small host message
  // whose transport has room): true when it has been sent, complete, with nothing to wait for
  // (no Request, so no RequestState to allocate: small collectives send most messages so); false
  // when nothing was sent, and the caller posts it with post(): whatever would make post() fail
  // (a bad argument, a gone peer, a shutdown) returns false, and post() then reports it. It
  // never overtakes a held post (post_after) it could match before. The default sends nothing.
  virtual bool send_now(const Buffer& buffer, int peer, TagKind kind, std::uint32_t tag) {
    (void)buffer;
    (void)peer;
    (void)kind;
    (void)tag;
    return false;
  }

  // Receives one buffer from `peer` (not kAnySource) inside this call if its message is there
  // already: true when it has been received, with `*bytes` its length. Otherwise false, and
  // either `*posted` holds the receive, posted (it completes, or has failed, as post()'s would:
  // a message too long, say, is its error; `name` names it as post()'s `name` does), or
  // `*posted` stays empty: nothing was posted, and the caller posts it with post(), which reports
  // what made this decline. It never overtakes a held post. The default posts nothing.
  virtual bool recv_now(const char* name, const Buffer& buffer, int peer, TagKind kind,
                        std::uint32_t tag, std::size_t* bytes, Request* posted) {
    (void)name;
    (void)buffer;
    (void)peer;
    (void)kind;
    (void)tag;
    (void)bytes;
    (void)posted;
    return false;
  }

  // post(), but a single buffer moves inside the call where the transport can (send_now; for a
  // receive from a given peer, recv_now): the Request then comes finished (done_request), with
  // no Op behind it. What they decline is posted. (Exchange keeps its own form: a collective's
  // messages need no Request at all.)
  Request move_or_post(Direction dir, const char* name, const Buffer* buffers, std::size_t count,
                       int peer, TagKind kind, std::uint32_t tag, bool fast_completion);

  Request post_send(const Buffer* buffers, std::size_t count, int peer, TagKind kind,
                    std::uint32_t tag, bool fast_completion = false) {
    return post(Direction::kSend, "send", buffers, count, peer, kind, tag, fast_completion);
  }
  Request post_recv(const Buffer* buffers, std::size_t count, int peer, TagKind kind,
                    std::uint32_t tag) {
    return post(Direction::kRecv, "recv", buffers, count, peer, kind, tag, false);
  }
};

// The channel behind a Communicator.
Channel& channel(Communicator& comm) noexcept;
// A Communicator over any channel (the test channels use it; the Communicator shuts it down).
std::unique_ptr<Communicator> communicator_over(std::shared_ptr<Channel> channel);
// A Request onto a state (for Channel implementations), and the state behind a Request (nullptr
// for a default-constructed one).
Request make_request(std::shared_ptr<RequestState> state) noexcept;
RequestState* state_of(const Request& request) noexcept;
// The Request of a message that Channel::send_now sent or recv_now received: finished and
// successful, `bytes` sent to or received from `peer` (what isend and irecv return for a message
// that needed no post).
Request done_request(int peer, std::size_t bytes, std::chrono::milliseconds default_timeout);

}  // namespace commux::detail
