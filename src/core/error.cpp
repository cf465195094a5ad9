#include "commux/error.hpp"

#include "status.hpp"

#include <utility>

namespace commux {

std::string with_wait_length(std::string reason, long long ms, bool anywhere) {
  const std::string lead = "Timed out after ";
  const std::size_t at = reason.find(lead);
  if (at == std::string::npos || (at != 0 && !anywhere)) return reason;
  const std::size_t end = reason.find(" ms", at);
  if (end == std::string::npos) return reason;
  reason.replace(at + lead.size(), end - at - lead.size(), std::to_string(ms));
  return reason;
}

const char* errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::kInvalidArgument: return "invalid argument";
    case Errc::kTimeout: return "timeout";
    case Errc::kTruncated: return "message truncated";
    case Errc::kPeerFailed: return "peer failed";
    case Errc::kCanceled: return "canceled";
    case Errc::kUnsupported: return "unsupported";
    case Errc::kWireMismatch: return "wire format mismatch";
    case Errc::kCallMismatch: return "call mismatch";
    case Errc::kTransport: return "transport error";
  }
  return "unknown";
}

std::string Error::compose(const ErrorSite& site, const std::string& reason, bool still_posted) {
  std::string s = site.op.empty() ? reason : "commux " + site.op + ": " + reason;
  if (still_posted) s += kStillPostedNote;
  return s;
}

Error::Error(Errc code, ErrorSite site, std::string reason, bool still_posted)
    : std::runtime_error(compose(site, reason, still_posted)),
      code_(code),
      site_(std::move(site)),
      reason_(std::move(reason)),
      still_posted_(still_posted) {}

std::string Error::describe() const {
  return site_.op.empty() ? reason_ : site_.op + ": " + reason_;
}

Error Error::with_still_posted(bool posted) const { return Error(code_, site_, reason_, posted); }

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
    case UCS_ERR_IO_ERROR: return Errc::kPeerFailed;
    default: return Errc::kTransport;
  }
}

Error error_from_status(ucs_status_t status, const std::string& what) {
  return Error(errc_from_status(status), "commux " + what + ": " + ucs_status_string(status) +
                                             " (UCX status " +
                                             std::to_string(static_cast<int>(status)) + ")");
}

Error error_from_status(ucs_status_t status, ErrorSite site, const std::string& context) {
  std::string reason = std::string(ucs_status_string(status)) + " (UCX status " +
                       std::to_string(static_cast<int>(status)) + ")";
  if (!context.empty()) reason = context + ": " + reason;
  return Error(errc_from_status(status), std::move(site), std::move(reason));
}

void check_status(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK && status != UCS_INPROGRESS) throw error_from_status(status, what);
}

}  // namespace detail
}  // namespace commux
