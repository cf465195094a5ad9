/* bench_common.h -- what commux_bench (C++) and mpi_pingpong (C) share, so that both measure and
 * check the same way: command-line flags, iteration plans, the data pattern, statistics and the
 * output (a human table on stderr, one JSON object).
 *
 * Data pattern: byte i of the message for (repetition r, iteration n, size s) is byte i % 8 of the
 * 64-bit word  mix(key(r, n) ^ mix(s)) ^ (i / 8) * golden  (see bench_common.c).
 *
 * Buffers ("slabs") hold `slots` messages side by side; iteration n uses slot n % slots. While
 * slots == iters every iteration has its own slot, so every byte of every message is checked after
 * the repetition (outside the timed loop). When the slab would exceed BENCH_SLAB_BYTES, slots are
 * reused: the sender stamps the first and last 8 bytes of each message with iteration n's pattern,
 * the receiver checks them every iteration, and every byte of the last message in each slot is
 * checked after the repetition. */
#ifndef COMMUX_BENCH_COMMON_H
#define COMMUX_BENCH_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  BENCH_EXIT_OK = 0,    /* ran, every byte correct */
  BENCH_EXIT_WRONG = 1, /* ran, some bytes wrong */
  BENCH_EXIT_ERROR = 2, /* did not run to the end (bad flag, failure, timeout) */
  BENCH_MAX_SIZES = 64
};

/* Bytes moved per repetition and the iteration cap, for point-to-point and for memcpy. */
#define BENCH_P2P_REP_BYTES ((size_t)32 << 20)
#define BENCH_P2P_MAX_ITERS 2000L
#define BENCH_COPY_REP_BYTES ((size_t)256 << 20)
#define BENCH_COPY_MAX_ITERS 100000L
#define BENCH_MIN_ITERS 4L
/* Largest slab that still gets one slot per iteration (fits L1/L2 like a single buffer would). */
#define BENCH_SLAB_BYTES ((size_t)64 << 10)

/* Flags both programs take: --sizes LIST, --reps N, --quick, --timeout SEC, --json FILE. */
typedef struct {
  size_t sizes[BENCH_MAX_SIZES];
  int nsizes;
  int reps;
  int quick;             /* fewer iterations (smoke tests) */
  int timeout_s;         /* watchdog */
  const char* json_path; /* NULL: JSON to stdout */
} bench_args;

void bench_args_init(bench_args* a);
/* Consumes argv[*i] (and its value, advancing *i) when it is a common flag: returns 1. Returns 0
 * for a flag it does not know, -1 (after a message on stderr) for a bad value. */
int bench_parse_common(bench_args* a, int argc, char** argv, int* i);
const char* bench_common_usage(void);
/* "4K" -> 4096 (K, M, G suffixes); 0 on a malformed or zero size; *end after the size. */
size_t bench_parse_size(const char* text, const char** end);
/* Writes s as a JSON string literal. */
void bench_json_string(FILE* f, const char* s);
/* Opens path (stdout when NULL) and writes the JSON object's start: {"program": "<program>".
   NULL, with a message on stderr, when it cannot. */
FILE* bench_json_open(const char* path, const char* program);

/* One size's schedule: `iters` timed iterations per repetition, `reps` repetitions after one
 * warm-up repetition, at most `window` messages in flight, `slots` messages per slab. */
typedef struct {
  size_t size;
  long iters;
  long window;
  long slots;
  int reps;
} bench_plan;

bench_plan bench_make_plan(const bench_args* a, size_t size, size_t rep_bytes, long max_iters,
                           long window);
/* Lowers p->iters to `iters` (at least BENCH_MIN_ITERS), with window and slots to match. */
void bench_limit_iters(bench_plan* p, long iters);

uint64_t bench_key(int rep, long iter);
void bench_fill(void* buf, size_t size, uint64_t key);
void bench_stamp(void* buf, size_t size, uint64_t key); /* first and last 8 bytes only */
void bench_poison(void* buf, size_t size);
/* Number of wrong bytes: the first and last 8 against `edge_key`, the rest against `body_key`. */
uint64_t bench_check(const void* buf, size_t size, uint64_t body_key, uint64_t edge_key);
uint64_t bench_check_edges(const void* buf, size_t size, uint64_t key);
/* A slab as the sender prepares it for repetition `rep`, and the check of one after it. */
void bench_fill_slab(void* slab, const bench_plan* p, int rep);
uint64_t bench_check_slab(const void* slab, const bench_plan* p, int rep);
void* bench_slot(void* slab, const bench_plan* p, long iter);

double bench_now_us(void);
/* Sorts `samples`. */
void bench_summarize(double* samples, int n, double* median, double* min);

/* SIGALRM after `seconds`: prints "<who>: watchdog ..." and _exit(BENCH_EXIT_ERROR). */
void bench_arm_watchdog(int seconds, const char* who);

typedef struct {
  const char* mode;
  size_t size;
  long iters;
  int reps;
  double time_us_median;
  double time_us_min;
  double gbps; /* size / time_us_median */
  uint64_t wrong;
} bench_row;

typedef struct {
  const char* key;
  const char* value;
} bench_kv;

void bench_print_header(FILE* f);
void bench_print_row(FILE* f, const bench_row* r);
/* {"program": ..., "info": {kv...}, "rows": [...]} to `path`, or stdout when NULL. 0 on success. */
int bench_write_json(const char* path, const char* program, const bench_kv* info, int ninfo,
                     const bench_row* rows, int nrows);

#ifdef __cplusplus
}
#endif

#endif /* COMMUX_BENCH_COMMON_H */
