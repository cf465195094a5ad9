#include "errors.hpp"

#include <c10/util/Exception.h>

#include "commux/error.hpp"

namespace commux::c10d_detail {

namespace {

// " Timed out " in a timeout's message (torch's tests match " (Timed out|closed|timeout) "), once:
// the core's waits already say "Timed out after ..." (src/core/op.cpp); other timeouts (a Work's
// own wait, a future, the init store lookup) get "Timed out - " after their "commux <op>: ".
std::string timeout_message(const Error& err) {
  std::string msg = err.what();
  if (msg.find("Timed out ") != std::string::npos) return msg;
  if (!err.op().empty()) {
    return Error(err.code(), err.site(), "Timed out - " + err.reason(), err.still_posted()).what();
  }
  const std::string prefix = "commux ";
  const std::size_t colon = msg.find(": ");
  if (msg.compare(0, prefix.size(), prefix) == 0 && colon != std::string::npos) {
    return msg.insert(colon + 2, "Timed out - ");
  }
  return "Timed out - " + msg;
}

}  // namespace

std::exception_ptr to_torch_error(std::exception_ptr e) {
  if (!e) return e;
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    const std::string msg = err.code() == Errc::kTimeout ? timeout_message(err) : err.what();
    try {
      if (err.code() == Errc::kInvalidArgument || err.code() == Errc::kUnsupported) {
        throw_value_error(msg);
      }
      throw_backend_error(msg);
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    return e;
  }
}

// c10's Error(msg, backtrace) constructor: with no backtrace, what() is the message alone (the
// SourceLocation constructors behind C10_THROW_ERROR / TORCH_CHECK append one).
void throw_value_error(const std::string& message) { throw c10::ValueError(message, nullptr); }
void throw_backend_error(const std::string& message) {
  throw c10::DistBackendError(message, nullptr);
}

std::string current_message() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

void throw_torch_error(std::exception_ptr e) { std::rethrow_exception(to_torch_error(e)); }

namespace {
thread_local const GroupScope* tl_scope = nullptr;
}  // namespace

GroupScope::GroupScope(const std::string& name, int rank, int size) noexcept
    : name_(name), rank_(rank), size_(size), outer_(tl_scope) {
  tl_scope = this;
}

GroupScope::~GroupScope() { tl_scope = outer_; }

std::string GroupScope::current() {
  const GroupScope* s = tl_scope;
  if (s == nullptr) return "";
  return "group '" + s->name_ + "', rank " + std::to_string(s->rank_) + " of " +
         std::to_string(s->size_);
}

void invalid_message(const std::string& message) {
  const std::string group = GroupScope::current();
  throw_value_error(group.empty() ? message : message + " (" + group + ")");
}

void invalid(const char* op, const std::string& what) {
  invalid_message(std::string("commux ") + op + ": " + what);
}

}  // namespace commux::c10d_detail
