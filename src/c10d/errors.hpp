// src/c10d/errors.hpp -- how the "ucx" backend reports errors to torch users (internal).
//
//   * to_torch_error(): the one mapping from commux::Error to torch's exception types;
//   * invalid(): a ValueError for bad input, "commux <op>: <what> (group '<name>', rank R of N)",
//     naming the group whose call is being validated on this thread (GroupScope).
#pragma once

#include <exception>
#include <string>

namespace commux::c10d_detail {

// Converts a commux::Error (or anything else) into the exception torch users expect:
// invalid input and unsupported memory -> c10::ValueError (Python ValueError), the rest ->
// c10::DistBackendError. A timeout's message says "Timed out" (torch's own tests and users grep
// " Timed out "). Anything that is not a commux::Error passes through unchanged.
std::exception_ptr to_torch_error(std::exception_ptr e);
[[noreturn]] void throw_torch_error(std::exception_ptr e);

// Throw c10::ValueError / c10::DistBackendError whose what() is `message` alone: no C++ source
// location and no backtrace ("Exception raised from ...", "frame #0 ...") in what users read.
// Every error the backend raises for its users is made by these.
[[noreturn]] void throw_value_error(const std::string& message);
[[noreturn]] void throw_backend_error(const std::string& message);
// The message of the exception being handled, without c10's backtrace (for a message that quotes
// another error: a c10::Error's what() carries the backtrace).
std::string current_message();

// While alive, invalid() on this thread names this group. A ProcessGroupUCX entry point opens one
// before it validates its arguments; they nest (the innermost wins). Costs two stores: the label
// is only formatted when an error is thrown.
class GroupScope {
 public:
  GroupScope(const std::string& name, int rank, int size) noexcept;
  ~GroupScope();
  GroupScope(const GroupScope&) = delete;
  GroupScope& operator=(const GroupScope&) = delete;

  // "group '<name>', rank R of N" for the innermost scope of this thread; "" outside any.
  static std::string current();

 private:
  const std::string& name_;
  int rank_;
  int size_;
  const GroupScope* outer_;
};

// Throws c10::ValueError("commux <op>: <what> (<GroupScope::current()>)").
[[noreturn]] void invalid(const char* op, const std::string& what);
// The same for a message composed elsewhere (a commux::Error's what()): message + " (<group>)".
[[noreturn]] void invalid_message(const std::string& message);

}  // namespace commux::c10d_detail
