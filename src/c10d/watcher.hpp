// src/c10d/watcher.hpp -- the thread that watches the backend's unfinished point-to-point Works
// (internal).
//
// Every p2p Work that is not finished when it is posted is kept here (tensors included) until its
// request finishes, so a Work the user dropped never frees a buffer UCX still uses -- and no
// longer than that: a finished Work is released at once, by wait() or by this thread, so its
// tensors live only as long as the user holds the Work. A future asked for before the request
// finished (getFuture(), e.g. by batch_isend_irecv's callers) is completed here too.
// Owned by the backend through a shared_ptr; Works hold a weak_ptr (P2PWork::set_watcher), so a
// Work that outlives its backend never calls into freed memory.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "work.hpp"

namespace commux::c10d_detail {

class FutureWatcher {
 public:
  ~FutureWatcher() { stop(); }
  // Keeps `work` (just posted, not finished) until its request finishes; starts the thread when
  // none runs (it ends after a second with nothing watched).
  void track(c10::intrusive_ptr<P2PWork> work);
  // getFuture() of an unfinished Work: makes sure it is watched, so that its future completes.
  void add(c10::intrusive_ptr<P2PWork> work);
  // Drops `work` now if its request has finished and its future (if any) is settled; true then.
  bool release(P2PWork* work);
  // Joins the thread. Call after the communicator is shut down (every request is then finished):
  // the futures still watched are completed, with the request's error where it has one.
  void stop();

 private:
  struct Entry {
    c10::intrusive_ptr<P2PWork> work;
    bool future = false;  // someone asked for its future: complete it promptly
  };
  void watch(c10::intrusive_ptr<P2PWork> work, bool future);
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> watched_;  // [mu_]
  int futures_ = 0;             // [mu_] entries with future == true
  bool retired_ = false;        // [mu_] the thread ended, idle (join it before starting one)
  bool stopping_ = false;       // [mu_]
  std::thread thread_;
};

}  // namespace commux::c10d_detail
