// The worker the communicators of a process share, and the group ids on it (hub.hpp).
#include "hub.hpp"

#include <array>
#include <chrono>
#include <mutex>
#include <string>

namespace commux::detail {

namespace {

// Every Hub of the process (weak: a Hub goes with its last Engine) and how many live Engines use
// each group id, over all Hubs (what join() publishes).
struct Registry {
  std::mutex mu;
  std::vector<std::weak_ptr<Hub>> hubs;
  std::array<int, tag_layout::kMaxGroups> in_use{};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: the atexit handler may use it late
  return *r;
}

std::vector<std::uint8_t> encode_ids(const Hub::Ids& ids) {
  std::vector<std::uint8_t> out(tag_layout::kMaxGroups / 8, 0);
  for (int i = 0; i < tag_layout::kMaxGroups; ++i) {
    if (ids[static_cast<std::size_t>(i)]) out[static_cast<std::size_t>(i / 8)] |= 1u << (i % 8);
  }
  return out;
}

Hub::Ids decode_ids(const std::vector<std::uint8_t>& v, int peer) {
  if (v.size() != tag_layout::kMaxGroups / 8) {
    throw Error(Errc::kWireMismatch,
                "commux init: rank " + std::to_string(peer) + " published a group-id set of " +
                    std::to_string(v.size()) + " bytes, not " +
                    std::to_string(tag_layout::kMaxGroups / 8) + " (a different commux version?)");
  }
  Hub::Ids ids;
  for (int i = 0; i < tag_layout::kMaxGroups; ++i) {
    if (v[static_cast<std::size_t>(i / 8)] & (1u << (i % 8))) ids.set(static_cast<std::size_t>(i));
  }
  return ids;
}

}  // namespace

Hub::Placement Hub::join(Store& store, int rank, int size, const Options& options, bool wakeup) {
  Registry& reg = registry();
  Ids mine;
  {
    std::lock_guard<std::mutex> lk(reg.mu);
    for (int i = 0; i < tag_layout::kMaxGroups; ++i) {
      if (reg.in_use[static_cast<std::size_t>(i)] > 0) mine.set(static_cast<std::size_t>(i));
    }
  }
  // Every member reads the same published sets and so takes the same id.
  const auto key = [&](int r) {
    return options.store_prefix + "/g" + std::to_string(options.group) + "/ids/" +
           std::to_string(r);
  };
  store.set(key(rank), encode_ids(mine));
  Ids all = mine;
  for (int p = 1; p < size; ++p) {
    const int peer = (rank + p) % size;
    std::vector<std::uint8_t> ids;
    try {
      ids = store.get(key(peer), options.timeout);
    } catch (const Error& e) {
      if (e.code() != Errc::kTimeout) throw;
      throw Error(Errc::kTimeout,
                  "commux init: rank " + std::to_string(peer) + " of " + std::to_string(size) +
                      " has not joined group " + std::to_string(options.group) + " within " +
                      std::to_string(options.timeout.count()) + " ms (this is rank " +
                      std::to_string(rank) + "; " + e.what() + ")");
    }
    all |= decode_ids(ids, peer);
  }
  int id = -1;
  for (int k = 0; k < tag_layout::kMaxGroups && id < 0; ++k) {
    const int c = (options.group + k) % tag_layout::kMaxGroups;
    if (!all[static_cast<std::size_t>(c)]) id = c;
  }
  if (id < 0) {
    throw Error(Errc::kInvalidArgument,
                ErrorSite{"init", {}, {}, {}, std::to_string(options.group)},
                "no free group id: the processes of this group's " + std::to_string(size) +
                    " ranks have all " + std::to_string(tag_layout::kMaxGroups) +
                    " ids in use among them (" + std::to_string(mine.count()) +
                    " by live communicators of rank " + std::to_string(rank) +
                    "'s process); shut down groups no longer used");
  }
  std::lock_guard<std::mutex> lk(reg.mu);
  std::shared_ptr<Hub> hub;
  for (auto it = reg.hubs.begin(); it != reg.hubs.end();) {
    std::shared_ptr<Hub> h = it->lock();
    if (!h) {
      it = reg.hubs.erase(it);
      continue;
    }
    if (!hub && h->wakeup_ == wakeup && !h->ids_[static_cast<std::size_t>(id)]) hub = h;
    ++it;
  }
  if (!hub) {
    hub = std::make_shared<Hub>(wakeup, static_cast<std::size_t>(size));
    reg.hubs.push_back(hub);
  }
  hub->ids_.set(static_cast<std::size_t>(id));
  ++reg.in_use[static_cast<std::size_t>(id)];
  return Placement{hub, id};
}

void Hub::release(int group) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lk(reg.mu);
  if (!ids_[static_cast<std::size_t>(group)]) return;
  ids_.reset(static_cast<std::size_t>(group));
  --reg.in_use[static_cast<std::size_t>(group)];
}

Hub::Hub(bool wakeup, std::size_t estimated_eps) : wakeup_(wakeup) {
  context_.create(wakeup, estimated_eps, info_);
  try {
    worker_.create(context_.handle(), wakeup, info_);
  } catch (...) {
    context_.destroy();
    throw;
  }
  worker_.start_progress_thread();
}

Hub::~Hub() { shutdown(); }

void Hub::shutdown() {
  worker_.stop_progress_thread();
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (worker_.shut_down_locked()) return;
  // What was sent to communicators that have gone would otherwise stay in UCX's buffers (and
  // UCX warns of each at worker_destroy).
  worker_.drop_unexpected_locked(0, 0,
                                 std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
  worker_.destroy_locked();  // the Engines closed their endpoints
  context_.destroy();        // the context last
  worker_.mark_shut_down_locked();
}

void Hub::shutdown_all() {
  std::vector<std::shared_ptr<Hub>> hubs;
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    for (auto& w : reg.hubs) {
      if (auto h = w.lock()) hubs.push_back(std::move(h));
    }
  }
  for (auto& h : hubs) h->shutdown();
}

}  // namespace commux::detail
