#include "call_hold.hpp"

#include <utility>

namespace commux::c10d_detail {

void hold_for(const CallRef& call, std::shared_ptr<const void> owner) {
  if (call.comm == nullptr || !owner) return;
  static_cast<void>(coll::hold_while_posted(*call.comm, call.tag, call.ntags, std::move(owner)));
}

HeldOnFailure::~HeldOnFailure() {
  // (The count is per thread, and a schedule may end on another thread than it began: an
  // exception in flight there still raises it above what the constructor saw, 0 on any thread
  // that runs collectives.)
  if (tensors_.empty() || std::uncaught_exceptions() <= unwinding_) return;
  hold_for(call_, std::make_shared<const std::vector<at::Tensor>>(std::move(tensors_)));
}

}  // namespace commux::c10d_detail
