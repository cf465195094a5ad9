// src/c10d/watcher.hpp -- the thread that completes the futures of point-to-point Works
// (internal).
//
// A p2p Work has no thread of its own that would notice its request finish; a future asked for
// before then (getFuture(), e.g. by batch_isend_irecv's callers) is completed here. Owned by the
// backend through a shared_ptr; Works hold a weak_ptr (P2PWork::set_watcher), so a Work that
// outlives its backend never calls into freed memory.
#pragma once

#include <mutex>
#include <thread>
#include <vector>

#include "work.hpp"

namespace commux::c10d_detail {

class FutureWatcher {
 public:
  ~FutureWatcher() { stop(); }
  void add(c10::intrusive_ptr<P2PWork> work);  // starts the polling thread on first use
  // Joins the thread. Call after the communicator is shut down (every request is then finished):
  // the futures still watched are completed, with the request's error where it has one.
  void stop();

 private:
  void loop();
  std::mutex mu_;
  std::vector<c10::intrusive_ptr<P2PWork>> watched_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace commux::c10d_detail
