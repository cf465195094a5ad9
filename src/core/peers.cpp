// Bootstrap, endpoints and peer health (docs/progress.md, "Failures and shutdown").
#include "peers.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "lanes.hpp"
#include "op.hpp"
#include "status.hpp"
#include "worker.hpp"

namespace commux::detail {

namespace {

using Clock = std::chrono::steady_clock;

std::string addr_key(const Options& o, int rank) {
  return o.store_prefix + "/g" + std::to_string(o.group) + "/addr/" + std::to_string(rank);
}

// Starts closing `ep`; returns the close request when it is still in progress, else nullptr.
void* start_close(ucp_ep_h ep, bool force) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* r = ucp_ep_close_nbx(ep, &prm);
  return UCS_PTR_IS_PTR(r) ? r : nullptr;
}

}  // namespace

void Peers::connect(Store& store, const Options& options) {
  ucp_address_t* address = nullptr;
  std::size_t address_len = 0;
  check_status(ucp_worker_get_address(worker_.handle(), &address, &address_len),
               "init: ucp_worker_get_address");
  const auto* a = reinterpret_cast<const std::uint8_t*>(address);
  const ProcessIdentity me = self_identity();
  store.set(addr_key(options, rank_),
            encode_record(PeerRecord{me, std::vector<std::uint8_t>(a, a + address_len)}));
  ucp_worker_release_address(worker_.handle(), address);

  peers_.assign(static_cast<std::size_t>(size_), Peer{});
  for (int p = 0; p < size_; ++p) {
    // Start with the right-hand neighbour so ranks do not all wait on rank 0's key first.
    const int peer = (rank_ + p) % size_;
    const PeerRecord remote = decode_record(store.get(addr_key(options, peer), options.timeout),
                                            "rank " + std::to_string(peer));
    Peer& pr = (*this)[peer];
    pr.identity = remote.identity;
    pr.same_host = remote.identity.host == me.host;
    pr.owner = this;
    pr.rank = peer;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.address.data());
    // Peer error handling would cost same-host peers their shared-memory transports (see
    // peer_record.hpp); those are watched by check_local() instead.
    ep.err_mode = pr.same_host ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Peers::ep_error_cb;
    ep.err_handler.arg = &pr;
    std::lock_guard<std::mutex> lock(worker_.mutex());
    const ucs_status_t created = ucp_ep_create(worker_.handle(), &ep, &pr.ep);
    if (created != UCS_OK && pr.same_host) {
      // A peer may finish its work (eager sends to us included) and leave before we connect;
      // its shared memory is gone then. That is a peer that left, not a failed start: messages
      // it sent are still delivered, and operations that need it fail naming this reason.
      pr.ep = nullptr;
      fail_locked(peer, created,
                  std::string("could not connect to its process ") +
                      std::to_string(remote.identity.pid) + " on this host (" +
                      ucs_status_string(created) + "): it has probably left already");
      continue;
    }
    check_status(created, "init: connecting to peer " + std::to_string(peer));
    log_peer_lanes(rank_, peer, options.group, pr.same_host, pr.ep);
  }
}

void Peers::ep_error_cb(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  peer->owner->fail_locked(peer->rank, status, ucs_status_string(status));
}

void Peers::fail_locked(int peer, ucs_status_t status, const std::string& reason) {
  // Sends to the peer are failed by UCX (peer error handling) or by the force-close in
  // check_local(). Receives are worker-level: messages the peer sent before it went may still be
  // in flight, so receives are failed later, once progress is idle and a grace period has passed
  // (reap_locked).
  Peer& pr = (*this)[peer];
  if (pr.status != UCS_OK) return;
  pr.status = status;
  pr.failed_at = Clock::now();
  pr.reason = reason;
  any_failed_ = true;
  for (Op* op = worker_.inflight_locked(); op != nullptr; op = op->next) {
    if (op->kind == Op::Kind::kSend && op->peer == peer && !op->has_override && mine(*op)) {
      op->has_override = true;
      op->override_code = Errc::kPeerFailed;
      op->override_reason = "peer " + std::to_string(peer) + " is gone (" + reason + ")";
    }
  }
}

bool Peers::mine(const Op& op) const noexcept {
  return static_cast<const void*>(op.engine.get()) == static_cast<const void*>(owner_);
}

void Peers::check_local() {
  std::vector<int> dead;
  for (int p = 0; p < size_; ++p) {
    const Peer& pr = (*this)[p];
    if (p != rank_ && pr.same_host && !process_alive(pr.identity)) dead.push_back(p);
  }
  if (dead.empty()) return;
  std::lock_guard<std::mutex> lock(worker_.mutex());
  if (worker_.shut_down_locked()) return;
  for (int p : dead) {
    Peer& pr = (*this)[p];
    if (pr.status != UCS_OK) continue;
    fail_locked(p, UCS_ERR_CONNECTION_RESET,
                "its process " + std::to_string(pr.identity.pid) + " on this host has exited");
    // Force-closing completes the sends still queued to it (with an error) and frees them.
    if (void* r = start_close(pr.ep, true)) closing_.push_back(r);
    pr.ep = nullptr;
  }
}

void Peers::reap_failed_locked() {
  constexpr auto kGrace = std::chrono::milliseconds(100);
  const auto now = Clock::now();
  if (now < next_reap_) return;
  next_reap_ = now + std::chrono::milliseconds(10);
  std::vector<std::shared_ptr<Op>> victims;
  for (Op* op = worker_.inflight_locked(); op != nullptr; op = op->next) {
    if (op->kind != Op::Kind::kRecv || op->has_override || !mine(*op)) continue;
    const int from = op->peer != kAnySource ? op->peer
                                            : (op->remaining > 0 && op->parts.size() > 1 &&
                                                       op->parts[0].ucx_req == nullptr
                                                   ? op->source
                                                   : kAnySource);
    if (from == kAnySource) continue;
    const Peer& pr = (*this)[from];
    if (pr.status != UCS_OK && now - pr.failed_at >= kGrace) victims.push_back(op->self);
  }
  for (auto& op : victims) {
    const int p = op->peer != kAnySource ? op->peer : op->source;
    op->has_override = true;
    op->override_code = Errc::kPeerFailed;
    op->override_reason = "peer " + std::to_string(p) + " is gone (" + (*this)[p].reason +
                          ") and no matching message from it had arrived";
    op->cancel_parts_locked(worker_.handle());
  }
}

void Peers::close_all_locked(Clock::time_point deadline) {
  std::vector<void*> closing;
  for (Peer& pr : peers_) {  // dead same-host peers are already closed
    if (pr.ep == nullptr) continue;
    if (void* r = start_close(pr.ep, pr.status != UCS_OK)) closing.push_back(r);
    pr.ep = nullptr;
  }
  while (!closing.empty() && Clock::now() < deadline) {
    if (ucp_worker_progress(worker_.handle()) == 0) ::usleep(50);
    closing.erase(std::remove_if(closing.begin(), closing.end(),
                                 [](void* r) {
                                   if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                   ucp_request_free(r);
                                   return true;
                                 }),
                  closing.end());
  }
  for (void* r : closing) ucp_request_free(r);  // released by UCX when the worker goes
  for (void* r : closing_) ucp_request_free(r);
  closing_.clear();
}

}  // namespace commux::detail
