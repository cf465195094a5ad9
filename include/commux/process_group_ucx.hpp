// commux/process_group_ucx.hpp -- the torch.distributed backend "ucx" (the one public header that
// includes torch).
//
//   auto store = c10::make_intrusive<c10d::FileStore>(path, size);
//   auto ucx = c10::make_intrusive<commux::ProcessGroupUCX>(store, rank, size);
//   auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
//   pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, ucx);
//
// Threads and progress: point-to-point operations are posted on the caller's thread and progress in
// commux's background progress thread (docs/progress.md). Collectives are queued per group, in call
// order; a thread of a pool shared by every group of the process runs a group's queue, one
// collective at a time, while it is not empty (a group with nothing queued holds no thread, and
// groups with collectives at the same time each get a thread), with the algorithms of
// <commux/collectives.hpp>; every rank of a group must issue its collectives in the same order (as
// with every torch backend).
//
// Ownership: the backend (not the Work) owns every in-flight operation together with the tensors
// it reads or writes, so a Work dropped before completion never frees memory UCX still uses.
// A Work keeps its output tensors and reports them through result() and getFuture().
//
// Groups: each ProcessGroupUCX (the default group and every new_group) has its own Communicator,
// i.e. its own endpoints and group id; the Communicators of a process share one UCX worker and
// progress thread, and the group id in every message keeps the groups from cross-talk.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "commux/communicator.hpp"  // communicator()

namespace commux {

class ProcessGroupUCX : public c10d::Backend {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(30)};

  // `store` is scoped to this group (torch passes a PrefixStore). `name` is what
  // getBackendName() reports ("ucx" or "commux"); `group_name` appears in error messages.
  ProcessGroupUCX(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout = kDefaultTimeout, std::string name = "ucx",
                  std::string group_name = "");
  ~ProcessGroupUCX() override;

  const std::string getBackendName() const override;
  std::chrono::milliseconds timeout() const;
  void setTimeout(std::chrono::milliseconds timeout) override;
  Communicator& communicator();
  // Collective calls that ran with device operations (reductions and scratch on the tensors'
  // device, through ATen): device tensors, and CPU tensors with COMMUX_ATEN_REDUCE=1.
  std::uint64_t device_ops_calls() const;
  // Collectives that ran on the thread that issued or waited for them (COMMUX_CALLER_RUNS), not
  // on the group's collective thread.
  std::uint64_t caller_ran_calls() const;
  // Collectives that started while another collective of the group was running
  // (COMMUX_INFLIGHT).
  std::uint64_t concurrent_calls() const;
  // How many collectives of the group may run at once (COMMUX_INFLIGHT, auto resolved) among
  // those that hold a thread; schedules (COMMUX_SCHEDULE) may be more under auto.
  int inflight() const;
  // Collectives started as schedules (COMMUX_SCHEDULE): async CPU collectives, and those a
  // waiter started from the queue.
  std::uint64_t scheduled_calls() const;

  // Sequence numbers (TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper uses them): the number of
  // collectives this group has issued, equal on every rank that issued the same calls.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;

  // Point-to-point: tags are honoured exactly. torch passes them as int, so they are 0 .. 2^31-1
  // here (a negative tag is refused); the core Communicator takes user tags up to 2^32-1.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // The coalescing window (batch_isend_irecv, _coalescing_manager): the Work endCoalescing returns
  // covers every operation issued on this thread's group since startCoalescing. With
  // COMMUX_GROUP=1 the sends and receives of the window are not posted when issued but together
  // at endCoalescing, receives first (so the peer's messages find them posted).
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // A blocking barrier that names the ranks that did not arrive, as Gloo's: every rank but 0
  // reports to rank 0 and waits for its answer; rank 0 waits until opts.timeout (0: the group's)
  // and raises DistBackendError "[Rank 0]: Rank 1 failed to pass monitoredBarrier in <T> ms"
  // naming the first missing rank, or "Ranks 1, 3 ..." every missing one when wait_all_ranks.
  // The ranks that arrived then fail too. (torch's dist.monitored_barrier() accepts gloo groups
  // only; call it on the group: pg.monitored_barrier(timeout, wait_all_ranks).) Its messages take
  // internal tags from the group's collective sequence: every rank calls it in the same order
  // relative to the group's collectives.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks = false) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;

  // The sparse all-to-all under commux.ep (expert-parallel dispatch and combine), on the calling
  // thread, in lanes: the message to rank p is one multi-buffer message holding, for every lane l
  // where it is not empty, lane l's part for p (send_bytes[l][p] bytes of sends[l], contiguous
  // 1-D uint8, parts in rank order); lane l's part from rank p lands in recvs[l] at
  // recv_offsets[l][p], in a slot of recv_capacity[l][p] bytes. Both sides must leave out the same
  // empty parts, i.e. know each other's sizes (commux.ep sends fixed-size headers first, by this
  // same call). Host or device memory, per lane. Returns the total bytes received from each rank,
  // -1 for a message longer than its slots (not an error here: commux.ep reports what it means).
  // Every request is waited for, even after another failed, so this rank's messages still reach
  // the ranks that wait for them. The messages travel on an internal tag drawn from the group's
  // collective sequence: every rank must call it in the same order relative to the group's
  // collectives. On any failure nothing stays posted into the caller's memory. `timeout` 0 means
  // the group's timeout.
  std::vector<std::int64_t> exchange_lanes(
      const std::string& op, const std::vector<at::Tensor>& sends,
      const std::vector<std::vector<std::int64_t>>& send_bytes,
      const std::vector<at::Tensor>& recvs,
      const std::vector<std::vector<std::int64_t>>& recv_offsets,
      const std::vector<std::vector<std::int64_t>>& recv_capacity,
      std::chrono::milliseconds timeout);

  // Cancels what is still in flight (its Works fail with "shut down"), waits for the collective
  // running (if any) to end and closes the endpoints; bounded by COMMUX_SHUTDOWN_TIMEOUT_MS. Idempotent; the destructor calls it.
  // Then raises DistBackendError if another rank had found that the ranks disagreed in a
  // collective that returned here (its results are wrong on some rank) and no later collective
  // of the group reported it; the destructor and abort() print that to stderr instead.
  void shutdown() override;
  void abort() override;

 private:
  // The backend's state (communicator, collective queue, in-flight operations, streams,
  // coalescing windows) lives in src/c10d (process_group_ucx_internal.hpp), not in this header.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace commux
