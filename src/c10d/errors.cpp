#include "errors.hpp"

#include <c10/util/Exception.h>

#include "commux/error.hpp"

namespace commux::c10d_detail {

std::exception_ptr to_torch_error(std::exception_ptr e) {
  if (!e) return e;
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    const std::string msg = err.what();
    try {
      if (err.code() == Errc::kInvalidArgument || err.code() == Errc::kUnsupported) {
        C10_THROW_ERROR(ValueError, msg);
      }
      C10_THROW_ERROR(DistBackendError, msg);
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    return e;
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
  C10_THROW_ERROR(ValueError, group.empty() ? message : message + " (" + group + ")");
}

void invalid(const char* op, const std::string& what) {
  invalid_message(std::string("commux ") + op + ": " + what);
}

}  // namespace commux::c10d_detail
