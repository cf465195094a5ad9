// Private to src/core: the one mapping from UCX status codes to commux errors.
#pragma once

#include <ucs/type/status.h>

#include <string>

#include "commux/error.hpp"

namespace commux::detail {

// Which commux error a UCX status is. UCS_OK is not an error; callers do not ask for it.
Errc errc_from_status(ucs_status_t status) noexcept;

// "commux <what>: <UCX's status string> (<UCX status name>)" as a commux::Error.
Error error_from_status(ucs_status_t status, const std::string& what);
// The same with the fields of `site`: "commux <site.op>: [<context>: ]<UCX's status string> (...)".
Error error_from_status(ucs_status_t status, ErrorSite site, const std::string& context);

// Throws error_from_status(status, what) unless status is UCS_OK (or UCS_INPROGRESS).
void check_status(ucs_status_t status, const std::string& what);

}  // namespace commux::detail
