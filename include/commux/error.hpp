// commux/error.hpp -- the one exception type commux throws.
//
// Every message starts with "commux <op>:" and names, where known, the peer, the tag and the byte
// counts involved, so a failure on one rank of many can be read without a debugger.
//
// An Error is data as well as text: the operation, peer, tag, bytes, group and whether the
// operation is still posted are fields with accessors, and what() is composed from them once, at
// construction (compose()). A layer that adds context (a collective naming itself around the
// send that failed, Request::wait saying the operation is still posted) builds a new Error from
// the fields of the one it caught; no layer reads another layer's text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace commux {

enum class Errc {
  kInvalidArgument,  // bad rank, tag, buffer or option; raised before anything is posted
  kTimeout,          // a wait passed its deadline; the operation is still posted (cancel() it)
  kTruncated,        // a message was longer than the receive buffer posted for it
  kPeerFailed,       // the peer process died or its endpoint failed
  kCanceled,         // the operation was cancelled (by the user or by shutdown)
  kUnsupported,      // the local UCX cannot do what was asked (e.g. a memory type it lacks)
  kWireMismatch,     // the peer used a different wire format (e.g. COMMUX_COALESCE differs)
  kCallMismatch,     // the ranks are in different collective calls, or disagree on its arguments
  kTransport,        // any other UCX failure
};

const char* errc_name(Errc code) noexcept;

// `reason` of a timeout ("Timed out after N ms (...)", as a wait says it) with N replaced by `ms`:
// a wait names its own length, and a caller that waited in slices (a collective, a Work) knows how
// long the whole wait was. Unchanged when it does not start that way (or, with `anywhere`, contain
// it).
std::string with_wait_length(std::string reason, long long ms, bool anywhere = false);

// What an error is about. Every field is optional: unset means "not known here".
struct ErrorSite {
  std::string op;                    // "send", "allreduce", "init", ... ("" = none)
  std::optional<int> peer;           // the peer rank (kAnySource = -1 for an any-source receive)
  std::optional<std::uint64_t> tag;  // the tag the operation was posted with
  std::optional<std::size_t> bytes;  // the bytes posted (the receive capacity, the send size)
  std::string group;                 // the group: core's group id, a torch group's name ("" = none)
};

class Error : public std::runtime_error {
 public:
  // What Request::wait() adds to a timeout whose operation stays posted.
  static constexpr const char* kStillPostedNote =
      "; the operation is still posted: wait again or cancel it";

  // A message given whole (no fields but the code); it is what() unchanged.
  Error(Errc code, const std::string& message)
      : std::runtime_error(message), code_(code), reason_(message) {}
  // A message composed from the fields: compose(site, reason, still_posted).
  Error(Errc code, ErrorSite site, std::string reason, bool still_posted = false);

  Errc code() const noexcept { return code_; }
  const std::string& op() const noexcept { return site_.op; }
  const std::optional<int>& peer() const noexcept { return site_.peer; }
  const std::optional<std::uint64_t>& tag() const noexcept { return site_.tag; }
  const std::optional<std::size_t>& bytes() const noexcept { return site_.bytes; }
  const std::string& group() const noexcept { return site_.group; }
  const ErrorSite& site() const noexcept { return site_; }
  // True when the operation this error is about is still posted (a Request::wait() timeout): it
  // may still complete, and its buffers must stay alive until it does or is cancelled.
  bool still_posted() const noexcept { return still_posted_; }
  // What went wrong, without the "commux <op>: " prefix and the still-posted note (for an Error
  // built from a whole message: that message).
  const std::string& reason() const noexcept { return reason_; }
  // The error as it reads below a layer that names itself: "<op>: <reason>" (or the reason alone
  // when no op is set). A collective wraps a failed send as "commux allreduce: " + this.
  std::string describe() const;

  // A copy with still_posted() set as given (the message recomposed).
  Error with_still_posted(bool posted) const;

  // "commux <op>: <reason>" (or the reason alone when op is empty), then kStillPostedNote when
  // still_posted.
  static std::string compose(const ErrorSite& site, const std::string& reason, bool still_posted);

 private:
  Errc code_;
  ErrorSite site_;
  std::string reason_;
  bool still_posted_ = false;
};

}  // namespace commux
