// commux/collectives.hpp -- torch-free collectives over a Communicator's internal point-to-point.
//
// Every function here is blocking: it posts internal (TagKind::kInternal) sends and receives with
// the caller-chosen `Context::tag`, waits for them with `Context::deadline`, and returns when this
// rank's part is complete. Callers that want asynchrony run them as a Schedule (at the end): the
// same call, suspended where it would wait and resumed by whichever thread drives it. All ranks must call the same collective, with the same tag and consistent arguments, in
// the same order; distinct collectives in flight at once must use distinct tags.
//
// Failure: a timeout, a dead peer or inconsistent sizes throw commux::Error whose message starts
// with "commux <Context::op_name>:" and names the peer where one is known. Before throwing, every
// request the collective still has posted is cancelled and completed, so neither user buffers nor
// scratch memory are touched after the function returns or throws.
//
// Ownership: the caller owns every buffer passed in for the duration of the call; scratch memory is
// allocated and freed inside (host memory, or Context::device's). Buffers live in `Context::mem`
// memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "commux/communicator.hpp"

namespace commux {

enum class DataType : std::uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kBool,
  kComplex64,
  kComplex128,
};

// Reductions the kernels apply element-wise (dst = dst OP src). AVG and PREMUL_SUM are built above
// this layer from kSum plus scale(). On bool: SUM and MAX are logical or, PRODUCT and MIN logical
// and (as NCCL does). MIN/MAX are not defined for complex; BAND/BOR/BXOR only for integers and bool.
enum class ReduceOp : std::uint8_t { kSum, kProduct, kMin, kMax, kBand, kBor, kBxor };

std::size_t dtype_size(DataType t) noexcept;
const char* dtype_name(DataType t) noexcept;
const char* reduce_op_name(ReduceOp op) noexcept;
bool is_floating(DataType t) noexcept;  // float16/bfloat16/float32/float64
bool is_complex(DataType t) noexcept;

// Throws Error(kInvalidArgument, "commux <op_name>: ReduceOp MIN is not defined for complex64 ...")
// when the kernels cannot apply `op` to `t`.
void check_reduction(const char* op_name, DataType t, ReduceOp op);

// dst[i] = dst[i] OP src[i] for i < count (host memory). float16/bfloat16 compute in float and
// round to nearest even, like torch.
void reduce_into(void* dst, const void* src, std::size_t count, DataType t, ReduceOp op);
// out[i] = a[i] OP b[i] (out may alias a or b).
void reduce_into(void* out, const void* a, const void* b, std::size_t count, DataType t,
                 ReduceOp op);
// buf[i] *= factor (floating and complex types only; AVG divides, PREMUL_SUM pre-scales).
void scale(void* buf, std::size_t count, DataType t, double factor);

namespace coll {

// The device side of collectives on device memory, injected by the caller (the torch backend
// implements it with ATen on a stream of its own; a C++ program may implement it with its own
// kernels). With Context::device set, a collective keeps its work in Context::mem memory: scratch
// comes from allocate(), reductions and local copies run through reduce() and copy(), and nothing
// is staged through host memory. Without it, device buffers are staged through host scratch and
// reduced by the host kernels above (correct, but every byte crosses the host bus twice).
//
// Every call is complete when it returns (the data is ready for UCX to read), so an
// implementation that queues device work synchronizes its own stream before returning. Each
// collective calls synchronize() before it touches any buffer, so device work the caller queued
// for its inputs (packing, scaling) on the DeviceOps' stream is complete first. Calls come from the
// thread running the collective; the object must outlive the call.
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  // Completes the device work queued so far (on the implementation's stream).
  virtual void synchronize() = 0;
  // Memory of at least `bytes` (bytes may be 0) in the Context's memory type, valid until
  // release(). Throws on failure.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void release(void* p) noexcept = 0;
  // out[i] = a[i] OP b[i] for i < count; out may alias a or b. OP as in reduce_into().
  virtual void reduce(void* out, const void* a, const void* b, std::size_t count, DataType t,
                      ReduceOp op) = 0;
  // Copies `bytes` (non-overlapping, or dst == src) between memories of the given types, one of
  // which is the Context's device memory.
  virtual void copy(void* dst, MemoryType dst_mem, const void* src, MemoryType src_mem,
                    std::size_t bytes) = 0;
};

struct Context {
  Communicator* comm = nullptr;
  std::uint32_t tag = 0;  // identifies this collective instance; equal on every rank
  // When the call's waits give up (Errc::kTimeout). max(): the communicator's Options::timeout,
  // counted from the call's first wait that has to wait.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  MemoryType mem = MemoryType::kHost;
  const char* op_name = "collective";  // used in error messages: "commux allreduce: ..."
  // Forces an algorithm of the collective called (a name from algorithms(op)); nullptr, "" or
  // "auto": the process-wide choice (force_algorithm(), else the COMMUX_ALGO_<OP> variable), and
  // without one the selector's (see force_algorithm below). Must be the same on every rank. A forced algorithm that cannot
  // handle the call (it declines, e.g. recursive doubling allgather on 6 ranks) gives way to the
  // selector's choice; an unknown name throws Error(kInvalidArgument) listing the valid ones.
  const char* algorithm = nullptr;
  // Device work for buffers in device memory (see DeviceOps); nullptr: stage through the host.
  DeviceOps* device = nullptr;
  // Cross-rank call checks. Every message of a collective carries a fingerprint of its call (the
  // collective, the algorithm, the sizes, data type, root and reduce op it was given, and
  // call_key), so that the messages of two different calls never pair up; a rank whose wait sees a
  // message or a notice of another call fails, on every rank involved, with kCallMismatch naming
  // both calls. call_key: what the caller knows must be equal on every rank beyond the arguments
  // the collective sees (e.g. a tensor's data type for a broadcast of bytes). call_text: how errors
  // describe the call ("1000 float32 SUM"); nullptr: described from the collective's arguments.
  std::uint64_t call_key = 0;
  const char* call_text = nullptr;
  // Called on the calling thread every 10 ms or so while the collective waits for a peer (never
  // when it completes within 25 ms). Whatever it throws stops the collective on this rank: what
  // is outstanding is cancelled, the other ranks of the call are told (their call fails with
  // kCallMismatch saying this rank stopped it) and the exception propagates unchanged. The torch
  // backend lets Ctrl-C through this way. nullptr: no calls.
  void (*poll)() = nullptr;
};

// Algorithm selection. `op` names a collective: "allreduce", "broadcast", "reduce", "allgather"
// (also allgatherv), "reduce_scatter", "alltoall" (alltoallv), "barrier", "gather", "scatter"
// (case-insensitive). An unknown op throws Error(kInvalidArgument) listing the valid ones.
//
// The names of `op`'s algorithms (what Context::algorithm and COMMUX_ALGO_<OP> accept).
std::vector<std::string> algorithms(const char* op);
// Process-wide forced algorithm for `op` (every thread, every call whose Context::algorithm is
// unset); nullptr, "" or "auto" clears it. Without one, the environment variable
// COMMUX_ALGO_<OP>=<name> forces it, read once per process (commux::settings()); OP upper case:
// ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCE_SCATTER, ALLTOALL, BARRIER, GATHER, SCATTER;
// "auto" or empty: the selector. Precedence:
// Context::algorithm, then force_algorithm(), then COMMUX_ALGO_<OP>, then the selector. Throws
// Error(kInvalidArgument) for an unknown op or algorithm name (an unknown name in the variable
// makes each call of that collective throw it, before anything is posted).
void force_algorithm(const char* op, const char* name);
// The forced algorithm of `op` in effect for calls without Context::algorithm (force_algorithm()'s,
// else COMMUX_ALGO_<OP>'s), "" when the selector chooses.
std::string forced_algorithm(const char* op);
// The algorithm the last collective called on this thread ran ("" before the first), e.g.
// "rabenseifner"; after a forced algorithm declined, the selector's choice that ran instead.
const char* last_algorithm() noexcept;

// Tells the other ranks that this rank will not take part in call ctx.tag (its arguments were
// rejected before anything was posted): their matching call fails at once with kCallMismatch
// naming this rank and `reason`, instead of waiting for it or pairing with this rank's next call.
// Never throws (a peer it cannot reach is skipped).
void reject(const Context& ctx, const std::string& reason) noexcept;
// Drops the messages of call ctx.tag that reached this rank after the call failed or was
// rejected here: they would otherwise wait in the transport, and a call's messages are told apart
// by the low 16 bits of its tag and its fingerprint, so they could pair with a call 65536 tags
// later. Returns how many were dropped.
std::size_t discard_call(const Context& ctx);
// Notices that nobody took: a rank that rejects a call, finds the ranks' calls disagreeing in it,
// or stops it tells every other rank, and one that had finished that call never reads it.
// find_notice looks for one of any call on ctx.comm (one progress call and one probe of the
// transport's unexpected messages, which it walks whole), without taking it: its call's tag and
// sender; only from `from` where it names a rank (a sender's notices arrive in the order sent).
// take_notice takes the notice of call ctx.tag from `sender`, drops the call's other leftovers
// (discard_call), and gives the call as the sender described it ("alltoall #0 (...)") and what
// it found there (empty where unknown).
// take_notice returns the notice's kind: 'R' (the sender rejected the call), 'M' (it found the
// ranks' calls disagreeing, or stopped the call), 'S' (say_shutdown: the sender never made the
// call; its other leftovers are kept), or '\0' (no notice from `sender`).
bool find_notice(const Context& ctx, std::uint32_t* call, int* sender, int from = kAnySource);
char take_notice(const Context& ctx, int sender, std::string* what, std::string* reason);
// Tells the other ranks that this rank has shut its collectives on ctx.comm down, and that
// ctx.tag is the first call it never made. It follows everything this rank sent before it (UCX
// keeps an endpoint's messages in order), so a rank that has taken every peer's has every notice
// they sent it; a rank waiting in call ctx.tag fails at once with kCallMismatch naming this rank.
// Never throws.
void say_shutdown(const Context& ctx) noexcept;
// A collective that fails cancels its requests, but a rendezvous transfer the transport has begun
// cannot always be taken back: it may still read from or write into the call's buffers after the
// call has thrown (its scratch is kept for it). Freeing such a buffer lets the transport read freed
// memory (a crash) or write into memory reused since (silent corruption). hold_while_posted hands
// `owner` (whatever keeps the call's buffers allocated; it may be empty, to ask only) to the
// transfers that the failed calls first_tag .. first_tag + ntags - 1 on `comm` left posted, and
// returns whether there were any: `owner` is then released once they have all finished (at a later
// collective's start, or a later hold_while_posted), and the caller may drop its own reference at
// once. false: none is left, so the buffers may be freed now. Throws only when out of memory. The
// torch backend hands over every tensor and staging buffer of a failed call this way.
bool hold_while_posted(const Communicator& comm, std::uint32_t first_tag, std::uint32_t ntags,
                       std::shared_ptr<const void> owner);
// The user field of the internal messages of call `tag` whose fingerprint is `fingerprint` (see
// commux/tag.hpp), for code that posts internal traffic of its own with a call's tag.
std::uint32_t call_wire_tag(std::uint32_t tag, std::uint64_t fingerprint) noexcept;

void barrier(const Context& ctx);
// `bytes` from root's buf to every rank's buf.
void broadcast(const Context& ctx, void* buf, std::size_t bytes, int root);
// In place: every rank's buf ends as the reduction of all ranks' bufs.
void allreduce(const Context& ctx, void* buf, std::size_t count, DataType t, ReduceOp op);
// Root's buf ends as the reduction; other ranks' bufs are only read.
void reduce(const Context& ctx, void* buf, std::size_t count, DataType t, ReduceOp op, int root);
// out (size * bytes) = concatenation of every rank's `in` (bytes each), in rank order.
// `in` may alias out + rank * bytes.
void allgather(const Context& ctx, const void* in, std::size_t bytes, void* out);
// Variable sizes: rank r contributes counts[r] bytes placed at out + displs[r].
void allgatherv(const Context& ctx, const void* in, void* out, const std::size_t* counts,
                const std::size_t* displs);
// On root: out (size * bytes) = every rank's `in` in rank order. `out` unused elsewhere.
void gather(const Context& ctx, const void* in, std::size_t bytes, void* out, int root);
// Root's `in` (size * bytes): rank r receives bytes at in + r * bytes into out.
void scatter(const Context& ctx, const void* in, void* out, std::size_t bytes, int root);
// `in` holds sum(counts) elements; rank r ends with the reduction of block r (counts[r] elements,
// at element offset sum(counts[0..r))) in `out`. `in` is not modified.
void reduce_scatter(const Context& ctx, const void* in, void* out, const std::size_t* counts,
                    DataType t, ReduceOp op);
// Personalized exchange in bytes: send_counts[p] bytes at in + send_displs[p] go to rank p, which
// receives them into out + recv_displs[me] (recv_counts[me] bytes). Every pair exchanges a message
// (zero bytes too), so ranks whose split sizes disagree fail with a message naming the peer and
// both sizes instead of hanging.
void alltoallv(const Context& ctx, const void* in, const std::size_t* send_counts,
               const std::size_t* send_displs, void* out, const std::size_t* recv_counts,
               const std::size_t* recv_displs);

// A collective call run as a resumable schedule: the non-blocking form of every function above
// (MPI_Iallreduce and friends), and how the torch backend runs async collectives.
//
// The constructor runs `call` (any code that makes one or more of the blocking calls above) on
// the calling thread until it has posted its first step and would wait for a request that is not
// complete; instead of blocking, the call is suspended there and the constructor returns. Later
// steps run when a thread resumes it (test(), wait(), or a driver that polls ready() and await()s
// several schedules): from the point where it waited, on that thread, with its reductions and
// copies. The call keeps its own stack, so every algorithm runs unchanged; its deadline, the
// cross-rank call checks and Context::poll (on the resuming thread) work as in a blocking call.
// Whatever the call throws is kept: error() once done(), rethrown by wait().
//
// Threads: any thread may resume a schedule, one at a time (a test() that finds another thread
// resuming it returns false at once). Distinct schedules in flight at once must use distinct
// Context::tag values, as any collectives in flight at once. The destructor of a schedule that
// is not done waits for it (bounded by its deadline). The call must not keep a pointer into a
// thread_local variable across a collective call: it may come back on another thread.
class Schedule {
 public:
  explicit Schedule(std::function<void()> call);
  ~Schedule();
  Schedule(const Schedule&) = delete;
  Schedule& operator=(const Schedule&) = delete;

  bool done() const noexcept;
  // Not done, and what it waits for has finished, or its deadline or next check has come: a
  // resume would run it on.
  bool ready() const noexcept;
  // Resumes it if ready() and no other thread is resuming it; returns done(). Never throws what
  // the call threw (see error()).
  bool test();
  // Resumes it with its waits blocking this thread, as the blocking call would, until it is done
  // (its deadline bounds that); false at once if another thread is resuming it. For a thread that
  // has nothing else to do meanwhile: faster than resuming it step by step where several
  // schedules would otherwise share one thread's sleeps.
  bool run_to_end();
  // Resumes it as often as needed until done or `timeout` has passed (sleeping on what it waits
  // for meanwhile); true when done. Rethrows what the call threw.
  bool wait(std::chrono::milliseconds timeout);
  // Blocks until what it waits for finishes, its next check is due, or `max` has passed, without
  // resuming it (a driver of several schedules sleeps on one of them this way). Made for a
  // thread that resumes schedules right after: where the host's ranks have a CPU each and none
  // to spare, other transfers in flight stay its to progress, and the core's progress thread
  // takes them up only at the end of its park (within 10 ms) once nobody waits.
  void await(std::chrono::microseconds max) const noexcept;
  // What the call threw, once done (nullptr: it returned).
  std::exception_ptr error() const noexcept;
  // Whether the calling code runs inside a schedule (e.g. to leave Context::poll unset there).
  static bool running() noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace coll
}  // namespace commux
