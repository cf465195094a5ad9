// src/c10d/call_hold.hpp -- what a failed collective's transfers may still use (internal).
//
// A collective that fails (a timeout, a peer's different call) cancels its requests, but a
// rendezvous transfer the transport has begun cannot always be taken back: it may read from or
// write into the call's buffers after the call has thrown. Every buffer of such a call -- the
// Task's tensors, a ListBuffer's staging, the copies a body makes -- is therefore handed to those
// transfers (coll::hold_while_posted) rather than freed, and freed once they have finished.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "commux/collectives.hpp"

namespace commux::c10d_detail {

// The calls a buffer serves: tags tag .. tag + ntags - 1 on comm (nullptr: none, as in tests).
struct CallRef {
  const Communicator* comm = nullptr;
  std::uint32_t tag = 0;
  std::uint32_t ntags = 1;
};

inline CallRef call_of(const coll::Context& ctx) { return CallRef{ctx.comm, ctx.tag, 1}; }

// Hands `owner` to the transfers that `call` left posted, if any (then it lives until they have
// finished); otherwise it is released here.
void hold_for(const CallRef& call, std::shared_ptr<const void> owner);

// Tensors a collective body makes for its call (a copy, a concatenation, a receive buffer): when
// the body leaves by an exception, they go to hold_for instead of being freed with its frame.
class HeldOnFailure {
 public:
  explicit HeldOnFailure(const CallRef& call) noexcept
      : call_(call), unwinding_(std::uncaught_exceptions()) {}
  ~HeldOnFailure();
  HeldOnFailure(const HeldOnFailure&) = delete;
  HeldOnFailure& operator=(const HeldOnFailure&) = delete;

  // Adds `t` and returns it.
  const at::Tensor& operator()(const at::Tensor& t) {
    tensors_.push_back(t);
    return t;
  }

 private:
  CallRef call_;
  int unwinding_;  // std::uncaught_exceptions() at construction
  std::vector<at::Tensor> tensors_;
};

}  // namespace commux::c10d_detail
