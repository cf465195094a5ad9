#include "commux/error.hpp"

#include "status.hpp"

namespace commux {

const char* errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::kInvalidArgument: return "invalid argument";
    case Errc::kTimeout: return "timeout";
    case Errc::kTruncated: return "message truncated";
    case Errc::kPeerFailed: return "peer failed";
    case Errc::kCanceled: return "canceled";
    case Errc::kUnsupported: return "unsupported";
    case Errc::kWireMismatch: return "wire format mismatch";
    case Errc::kTransport: return "transport error";
  }
  return "unknown";
}

namespace detail {

Errc errc_from_status(ucs_status_t status) noexcept {
  switch (status) {
    case UCS_ERR_MESSAGE_TRUNCATED: return Errc::kTruncated;
    case UCS_ERR_CANCELED: return Errc::kCanceled;
    case UCS_ERR_TIMED_OUT: return Errc::kTimeout;
    case UCS_ERR_INVALID_PARAM: return Errc::kInvalidArgument;
    case UCS_ERR_UNSUPPORTED: return Errc::kUnsupported;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
      return Errc::kPeerFailed;
    default: return Errc::kTransport;
  }
}

Error error_from_status(ucs_status_t status, const std::string& what) {
  return Error(errc_from_status(status),
               "commux " + what + ": " + ucs_status_string(status) + " (UCX status " +
                   std::to_string(static_cast<int>(status)) + ")");
}

void check_status(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK && status != UCS_INPROGRESS) throw error_from_status(status, what);
}

}  // namespace detail
}  // namespace commux
