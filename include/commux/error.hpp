// commux/error.hpp -- the one exception type commux throws.
//
// Every message starts with "commux <op>:" and names, where known, the peer, the tag and the byte
// counts involved, so a failure on one rank of many can be read without a debugger.
#pragma once

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
  kTransport,        // any other UCX failure
};

const char* errc_name(Errc code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
  Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

}  // namespace commux
