/* coll_common.h -- what the collective benchmarks share: mpi_coll (Open MPI) and commux_coll_bench
 * (commux's C++ collectives), and, spelled in Python, bench/coll_bench.py's torch.distributed ranks.
 * All three measure, size and check every operation the same way (nccl-tests' conventions):
 *
 *   sizes     `bytes` is the per-rank buffer: the in-place buffer (allreduce, broadcast, reduce),
 *             the send and the receive buffer (p2p), the output of allgather, the input of
 *             reduce_scatter, the input and output of alltoall. The gather-type ops move blocks of
 *             `chunk` = bytes / (4 n) float32 elements (at least 1), so their bytes round down to a
 *             multiple of 4 n. Everything is float32; barrier moves nothing (bytes 0).
 *   p2p       nccl-tests' sendrecv: every rank sends to rank + 1 and receives from rank - 1 (mod n),
 *             both posted non-blocking, then waits for both.
 *   roots     broadcast and reduce use root 0; reductions are SUM.
 *   values    element i of rank r's input is v(r, i) = (i * 7 + r * 131 + salt) % 1021, an
 *             integer, so every sum over up to 16 ranks is exact in float32 in any order.
 *   timing    per (op, size): `warmup` iterations (rank 0 takes their median and fits the plan to the time
 *             budget, then tells the other ranks), then `reps` repetitions of `iters` back-to-back
 *             iterations, each repetition after a barrier. A rank's time per repetition is its
 *             elapsed time / iters; the repetition's time is the maximum over ranks; the row reports
 *             them all (the driver takes the median).
 *   checking  after the timed repetitions, once more: inputs filled with v(r, i) for this row's
 *             salt, outputs poisoned (-1), one operation, every output element compared (reduce:
 *             the root's only). #wrong counts wrong elements over all ranks. As in nccl-tests, the
 *             timed iterations run on whatever the buffers hold (in-place sums grow, harmlessly).
 */
#ifndef COMMUX_COLL_COMMON_H
#define COMMUX_COLL_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "bench_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  COLL_P2P,
  COLL_ALLREDUCE,
  COLL_BROADCAST,
  COLL_REDUCE,
  COLL_ALLGATHER,
  COLL_REDUCE_SCATTER,
  COLL_ALLTOALL,
  COLL_BARRIER,
  COLL_NOPS
} coll_op;

enum {
  COLL_MAX_SIZES = 64,
  COLL_MAX_REPS = 64,
  COLL_EXIT_OK = 0,
  COLL_EXIT_WRONG = 1,
  COLL_EXIT_ERROR = 2
};

const char* coll_op_name(coll_op op);

typedef struct {
  coll_op ops[COLL_NOPS];
  int nops;
  size_t sizes[COLL_MAX_SIZES];
  int nsizes;
  int reps;         /* timed repetitions (at most COLL_MAX_REPS) */
  int min_reps;     /* the budget may lower reps down to this */
  long warmup;      /* warm-up iterations; 0: iters / 10, 1 .. 10 */
  size_t rep_bytes; /* iterations per repetition: rep_bytes / bytes, clamped */
  long min_iters;
  long max_iters;
  double budget_ms; /* the timed repetitions of one (op, size) together, roughly */
  unsigned salt;    /* varies the checked values between runs */
  int timeout_s;    /* watchdog of the whole run */
  int np;           /* ranks (commux_coll_bench forks them; mpi_coll takes MPI's) */
  const char* json_path;
} coll_args;

/* Parses argv into a (defaults first). Returns 0, or -1 after a message on stderr. Flags:
 * --ops LIST --sizes LIST --reps N --min-reps N --warmup N --rep-bytes N --min-iters N
 * --max-iters N --budget-ms X --salt N --timeout SEC --np N --json FILE. */
int coll_parse_args(coll_args* a, int argc, char** argv, const char* program);
const char* coll_usage(void);

typedef struct {
  size_t count; /* float32 elements of the per-rank buffer */
  size_t chunk; /* elements per rank block (gather-type ops), else count */
  size_t bytes; /* count * 4 */
} coll_shape;

coll_shape coll_make_shape(coll_op op, size_t size, int nranks);
long coll_plan_iters(const coll_args* a, size_t bytes);
long coll_plan_warmup(const coll_args* a, long iters);
/* Rank 0: lowers iters, then reps (to min_reps), so that reps * iters * us_per_iter fits the
 * budget. */
void coll_fit_budget(const coll_args* a, double us_per_iter, long* iters, int* reps);

float coll_value(int rank, size_t index, unsigned salt);
unsigned coll_row_salt(const coll_args* a, coll_op op, int size_index);
/* buf[j] = v(rank, offset + j) for j < n. */
void coll_fill(float* buf, size_t n, int rank, size_t offset, unsigned salt);
void coll_poison(float* buf, size_t n);
/* Wrong elements in this rank's output of one checked operation (see the header comment for
 * which buffer that is). */
uint64_t coll_check(coll_op op, int rank, int nranks, const coll_shape* s, const float* out,
                    unsigned salt);

typedef struct {
  coll_op op;
  size_t bytes;
  size_t count;
  long iters;
  long warmup;
  int reps;
  double times_us[COLL_MAX_REPS]; /* per repetition, max over ranks */
  uint64_t wrong;
} coll_row;

/* Before the checked operation: fills this rank's input, poisons the output (see the header
 * comment). `in` and `out` hold `count` elements each. coll_output says which one to check. */
void coll_prepare_check(coll_op op, int rank, const coll_shape* s, float* in, float* out,
                        unsigned salt);
const float* coll_output(coll_op op, const float* in, const float* out);

/* What one implementation provides to coll_run_size. */
typedef struct {
  void* ctx;
  int rank;
  int nranks;
  /* One operation: input `in`, output `out` (in-place ops use `in` only). */
  void (*run)(void* ctx, coll_op op, const coll_shape* s, float* in, float* out);
  void (*barrier)(void* ctx);
  /* Rank 0's two longs to every rank. */
  void (*share_plan)(void* ctx, long plan[2]);
  /* On rank 0: times[k] = max over ranks, *wrong = sum over ranks. */
  void (*gather_results)(void* ctx, double* times, int reps, uint64_t* wrong);
} coll_backend;

/* One (op, size): warm-up, budget fit, timed repetitions, the check. The row is complete on rank 0.
 * `in` and `out` hold at least coll_make_shape(op, size, n).count elements. */
coll_row coll_run_size(const coll_args* a, const coll_backend* b, coll_op op, int size_index,
                       float* in, float* out);

/* {"program", "backend", "world", "info": {...}, "rows": [...]} to path (stdout when NULL). */
int coll_write_json(const char* path, const char* program, const char* backend, int world,
                    const char* const* info_kv, int ninfo, const coll_row* rows, int nrows);
void coll_print_row(FILE* f, const coll_row* r);

#ifdef __cplusplus
}
#endif

#endif /* COMMUX_COLL_COMMON_H */
