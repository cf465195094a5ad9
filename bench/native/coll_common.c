#define _POSIX_C_SOURCE 200809L
#include "coll_common.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char* const kOpNames[COLL_NOPS] = {"p2p",      "allreduce", "broadcast",
                                                "reduce",   "allgather", "reduce_scatter",
                                                "alltoall", "barrier"};
static const size_t kDefaultSizes[] = {8,         64,      512,      4 << 10, 32 << 10,
                                       256 << 10, 2 << 20, 16 << 20, 64 << 20};

const char* coll_op_name(coll_op op) { return op < COLL_NOPS ? kOpNames[op] : "?"; }

const char* coll_usage(void) {
  return "  --ops LIST        p2p,allreduce,broadcast,reduce,allgather,reduce_scatter,alltoall,\n"
         "                    barrier (default all)\n"
         "  --sizes LIST      per-rank buffer bytes, e.g. 8,4K,1M (default 8 .. 64M, x8)\n"
         "  --reps N          timed repetitions (default 5)   --min-reps N (default 3)\n"
         "  --warmup N        warm-up iterations (default iters/10, 1 .. 10)\n"
         "  --rep-bytes N     bytes per repetition (default 32M): iters = N / bytes, clamped to\n"
         "  --min-iters N     (default 1) .. --max-iters N (default 200)\n"
         "  --budget-ms X     timed part of one (op, size), roughly (default 200)\n"
         "  --salt N          varies the checked values (default 0)\n"
         "  --timeout SEC     watchdog (default 300)   --np N   ranks (commux_coll_bench)\n"
         "  --json FILE       write the JSON there instead of stdout\n";
}

static int parse_sizes(coll_args* a, const char* text) {
  a->nsizes = 0;
  const char* p = text;
  while (*p != '\0') {
    const char* end = p;
    const size_t s = bench_parse_size(p, &end);
    if (s == 0 || (*end != ',' && *end != '\0') || a->nsizes == COLL_MAX_SIZES) return -1;
    a->sizes[a->nsizes++] = s;
    p = *end == ',' ? end + 1 : end;
  }
  return a->nsizes > 0 ? 0 : -1;
}

static int parse_ops(coll_args* a, const char* text) {
  a->nops = 0;
  const char* p = text;
  while (*p != '\0') {
    const size_t len = strcspn(p, ",");
    int found = -1;
    for (int o = 0; o < COLL_NOPS; ++o) {
      if (strlen(kOpNames[o]) == len && strncmp(p, kOpNames[o], len) == 0) found = o;
    }
    if (found < 0 || a->nops == COLL_NOPS) return -1;
    a->ops[a->nops++] = (coll_op)found;
    p += len;
    if (*p == ',') ++p;
  }
  return a->nops > 0 ? 0 : -1;
}

static int parse_long(const char* text, long lo, long hi, long* out) {
  char* end = NULL;
  errno = 0;
  const long v = strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

int coll_parse_args(coll_args* a, int argc, char** argv, const char* program) {
  memset(a, 0, sizeof(*a));
  for (int o = 0; o < COLL_NOPS; ++o) a->ops[o] = (coll_op)o;
  a->nops = COLL_NOPS;
  a->nsizes = (int)(sizeof(kDefaultSizes) / sizeof(kDefaultSizes[0]));
  memcpy(a->sizes, kDefaultSizes, sizeof(kDefaultSizes));
  a->reps = 5;
  a->min_reps = 3;
  a->rep_bytes = (size_t)32 << 20;
  a->min_iters = 1;
  a->max_iters = 200;
  a->budget_ms = 200;
  a->timeout_s = 300;
  a->np = 2;
  for (int i = 1; i < argc; ++i) {
    const char* flag = argv[i];
    if (strcmp(flag, "-h") == 0 || strcmp(flag, "--help") == 0) {
      fprintf(stdout, "usage: %s [options]\n%s", program, coll_usage());
      exit(COLL_EXIT_OK);
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "%s: unknown flag or missing value: '%s'\n%s", program, flag, coll_usage());
      return -1;
    }
    const char* value = argv[++i];
    long v = 0;
    int rc = 0;
    if (strcmp(flag, "--ops") == 0) {
      rc = parse_ops(a, value);
    } else if (strcmp(flag, "--sizes") == 0) {
      rc = parse_sizes(a, value);
    } else if (strcmp(flag, "--reps") == 0) {
      rc = parse_long(value, 1, COLL_MAX_REPS, &v);
      a->reps = (int)v;
    } else if (strcmp(flag, "--min-reps") == 0) {
      rc = parse_long(value, 1, COLL_MAX_REPS, &v);
      a->min_reps = (int)v;
    } else if (strcmp(flag, "--warmup") == 0) {
      rc = parse_long(value, 0, 1000000, &a->warmup);
    } else if (strcmp(flag, "--rep-bytes") == 0) {
      const char* end = value;
      a->rep_bytes = bench_parse_size(value, &end);
      rc = a->rep_bytes > 0 && *end == '\0' ? 0 : -1;
    } else if (strcmp(flag, "--min-iters") == 0) {
      rc = parse_long(value, 1, 1000000, &a->min_iters);
    } else if (strcmp(flag, "--max-iters") == 0) {
      rc = parse_long(value, 1, 1000000, &a->max_iters);
    } else if (strcmp(flag, "--budget-ms") == 0) {
      char* end = NULL;
      a->budget_ms = strtod(value, &end);
      rc = end != value && *end == '\0' && a->budget_ms > 0 ? 0 : -1;
    } else if (strcmp(flag, "--salt") == 0) {
      rc = parse_long(value, 0, 1000000, &v);
      a->salt = (unsigned)v;
    } else if (strcmp(flag, "--timeout") == 0) {
      rc = parse_long(value, 1, 100000, &v);
      a->timeout_s = (int)v;
    } else if (strcmp(flag, "--np") == 0) {
      rc = parse_long(value, 1, 64, &v);
      a->np = (int)v;
    } else if (strcmp(flag, "--json") == 0) {
      a->json_path = value;
    } else {
      fprintf(stderr, "%s: unknown flag '%s'\n%s", program, flag, coll_usage());
      return -1;
    }
    if (rc != 0) {
      fprintf(stderr, "%s: bad value for %s: '%s'\n", program, flag, value);
      return -1;
    }
  }
  if (a->min_iters > a->max_iters || a->min_reps > a->reps) {
    fprintf(stderr, "%s: --min-iters/--min-reps above --max-iters/--reps\n", program);
    return -1;
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Shapes and plans */

coll_shape coll_make_shape(coll_op op, size_t size, int nranks) {
  coll_shape s;
  const size_t n = (size_t)nranks;
  if (op == COLL_BARRIER) {
    s.count = s.chunk = 0;
  } else if (op == COLL_ALLGATHER || op == COLL_REDUCE_SCATTER || op == COLL_ALLTOALL) {
    s.chunk = size / 4 / n > 0 ? size / 4 / n : 1;
    s.count = s.chunk * n;
  } else {
    s.count = size / 4 > 0 ? size / 4 : 1;
    s.chunk = s.count;
  }
  s.bytes = s.count * 4;
  return s;
}

static long clamp_long(long v, long lo, long hi) { return v < lo ? lo : (v > hi ? hi : v); }

long coll_plan_iters(const coll_args* a, size_t bytes) {
  if (bytes == 0) return a->max_iters;
  return clamp_long((long)(a->rep_bytes / bytes), a->min_iters, a->max_iters);
}

long coll_plan_warmup(const coll_args* a, long iters) {
  return a->warmup > 0 ? a->warmup : clamp_long(iters / 10, 1, 10);
}

void coll_fit_budget(const coll_args* a, double us_per_iter, long* iters, int* reps) {
  if (us_per_iter <= 0) return;
  const double budget_us = a->budget_ms * 1e3;
  const double fit_iters = budget_us / (us_per_iter * *reps);
  *iters = clamp_long(fit_iters < (double)*iters ? (long)fit_iters : *iters, a->min_iters, *iters);
  const double fit_reps = budget_us / (us_per_iter * (double)*iters);
  const long r = clamp_long(fit_reps < (double)*reps ? (long)fit_reps : *reps, a->min_reps, *reps);
  *reps = (int)r;
}

/* ---------------------------------------------------------------------------------------------
 * Values and checks */

float coll_value(int rank, size_t index, unsigned salt) {
  return (float)((index * 7 + (size_t)rank * 131 + salt) % 1021);
}

unsigned coll_row_salt(const coll_args* a, coll_op op, int size_index) {
  return (a->salt * 97u + (unsigned)op * 13u + (unsigned)size_index * 3u) % 1021u;
}

void coll_fill(float* buf, size_t n, int rank, size_t offset, unsigned salt) {
  for (size_t j = 0; j < n; ++j) buf[j] = coll_value(rank, offset + j, salt);
}

void coll_poison(float* buf, size_t n) {
  for (size_t j = 0; j < n; ++j) buf[j] = -1.0f;
}

static float sum_over_ranks(int nranks, size_t index, unsigned salt) {
  float s = 0;
  for (int q = 0; q < nranks; ++q) s += coll_value(q, index, salt);
  return s;
}

uint64_t coll_check(coll_op op, int rank, int nranks, const coll_shape* s, const float* out,
                    unsigned salt) {
  uint64_t wrong = 0;
  const size_t c = s->chunk;
  const size_t me = (size_t)rank;
  switch (op) {
    case COLL_P2P:
      for (size_t i = 0; i < s->count; ++i) {
        wrong += out[i] != coll_value((rank + nranks - 1) % nranks, i, salt);
      }
      break;
    case COLL_ALLREDUCE:
      for (size_t i = 0; i < s->count; ++i) wrong += out[i] != sum_over_ranks(nranks, i, salt);
      break;
    case COLL_REDUCE:
      if (rank != 0) break;
      for (size_t i = 0; i < s->count; ++i) wrong += out[i] != sum_over_ranks(nranks, i, salt);
      break;
    case COLL_BROADCAST:
      for (size_t i = 0; i < s->count; ++i) wrong += out[i] != coll_value(0, i, salt);
      break;
    case COLL_ALLGATHER:
      for (int q = 0; q < nranks; ++q) {
        for (size_t j = 0; j < c; ++j) wrong += out[(size_t)q * c + j] != coll_value(q, j, salt);
      }
      break;
    case COLL_REDUCE_SCATTER:
      for (size_t j = 0; j < c; ++j) wrong += out[j] != sum_over_ranks(nranks, me * c + j, salt);
      break;
    case COLL_ALLTOALL:
      for (int q = 0; q < nranks; ++q) {
        for (size_t j = 0; j < c; ++j) {
          wrong += out[(size_t)q * c + j] != coll_value(q, me * c + j, salt);
        }
      }
      break;
    case COLL_BARRIER:
    case COLL_NOPS: break;
  }
  return wrong;
}

void coll_prepare_check(coll_op op, int rank, const coll_shape* s, float* in, float* out,
                        unsigned salt) {
  if (op == COLL_BARRIER) return;
  if (op == COLL_BROADCAST && rank != 0) {
    coll_poison(in, s->count);
  } else {
    coll_fill(in, op == COLL_ALLGATHER ? s->chunk : s->count, rank, 0, salt);
  }
  if (op == COLL_P2P || op == COLL_ALLGATHER || op == COLL_REDUCE_SCATTER || op == COLL_ALLTOALL) {
    coll_poison(out, op == COLL_REDUCE_SCATTER ? s->chunk : s->count);
  }
}

const float* coll_output(coll_op op, const float* in, const float* out) {
  return op == COLL_ALLREDUCE || op == COLL_BROADCAST || op == COLL_REDUCE ? in : out;
}

static int compare_double(const void* x, const void* y) {
  const double a = *(const double*)x;
  const double b = *(const double*)y;
  return (a > b) - (a < b);
}

coll_row coll_run_size(const coll_args* a, const coll_backend* b, coll_op op, int size_index,
                       float* in, float* out) {
  coll_row row;
  memset(&row, 0, sizeof(row));
  const coll_shape s = coll_make_shape(op, a->sizes[size_index], b->nranks);
  const unsigned salt = coll_row_salt(a, op, size_index);
  long iters = coll_plan_iters(a, s.bytes);
  const long warmup = coll_plan_warmup(a, iters);
  int reps = a->reps;
  /* The timed iterations run on checked-pattern data too (it is what the buffers hold). */
  coll_prepare_check(op, b->rank, &s, in, out, salt);
  /* The warm-up's median iteration sets the pace (the first call may set up connections). */
  double warm[COLL_MAX_REPS];
  int nwarm = 0;
  b->barrier(b->ctx);
  for (long i = 0; i < warmup; ++i) {
    const double w0 = bench_now_us();
    b->run(b->ctx, op, &s, in, out);
    if (nwarm < COLL_MAX_REPS) warm[nwarm++] = bench_now_us() - w0;
  }
  qsort(warm, (size_t)nwarm, sizeof(double), compare_double);
  const double warm_us = warm[nwarm / 2];
  long plan[2] = {iters, reps};
  if (b->rank == 0) {
    coll_fit_budget(a, warm_us, &iters, &reps);
    plan[0] = iters;
    plan[1] = reps;
  }
  b->share_plan(b->ctx, plan);
  iters = plan[0];
  reps = (int)plan[1];
  for (int k = 0; k < reps; ++k) {
    b->barrier(b->ctx);
    const double t0 = bench_now_us();
    for (long i = 0; i < iters; ++i) b->run(b->ctx, op, &s, in, out);
    row.times_us[k] = (bench_now_us() - t0) / (double)iters;
  }
  b->barrier(b->ctx);
  coll_prepare_check(op, b->rank, &s, in, out, salt);
  b->run(b->ctx, op, &s, in, out);
  uint64_t wrong = coll_check(op, b->rank, b->nranks, &s, coll_output(op, in, out), salt);
  b->gather_results(b->ctx, row.times_us, reps, &wrong);
  row.op = op;
  row.bytes = s.bytes;
  row.count = s.count;
  row.iters = iters;
  row.warmup = warmup;
  row.reps = reps;
  row.wrong = wrong;
  return row;
}

/* ---------------------------------------------------------------------------------------------
 * Output (time and the watchdog come from bench_common) */

int coll_write_json(const char* path, const char* program, const char* backend, int world,
                    const char* const* info_kv, int ninfo, const coll_row* rows, int nrows) {
  FILE* f = bench_json_open(path, program);
  if (f == NULL) return -1;
  fputs(", \"backend\": ", f);
  bench_json_string(f, backend);
  fprintf(f, ", \"world\": %d, \"info\": {", world);
  for (int i = 0; i < ninfo; ++i) {
    fputs(i > 0 ? ", " : "", f);
    bench_json_string(f, info_kv[2 * i]);
    fputs(": ", f);
    bench_json_string(f, info_kv[2 * i + 1]);
  }
  fputs("}, \"rows\": [", f);
  for (int i = 0; i < nrows; ++i) {
    const coll_row* r = &rows[i];
    fputs(i > 0 ? ",\n  " : "\n  ", f);
    fputs("{\"op\": ", f);
    bench_json_string(f, coll_op_name(r->op));
    fprintf(f,
            ", \"bytes\": %zu, \"count\": %zu, \"iters\": %ld, \"warmup\": %ld, \"reps\": %d, "
            "\"times_us\": [",
            r->bytes, r->count, r->iters, r->warmup, r->reps);
    for (int k = 0; k < r->reps; ++k) fprintf(f, "%s%.6g", k > 0 ? ", " : "", r->times_us[k]);
    fprintf(f, "], \"wrong\": %" PRIu64 "}", r->wrong);
  }
  fputs("]}\n", f);
  const int failed = ferror(f) != 0;
  if (path != NULL ? fclose(f) != 0 : fflush(f) != 0) return -1;
  return failed ? -1 : 0;
}

void coll_print_row(FILE* f, const coll_row* r) {
  double best = r->reps > 0 ? r->times_us[0] : 0;
  for (int k = 1; k < r->reps; ++k) best = r->times_us[k] < best ? r->times_us[k] : best;
  fprintf(f, "%15s %10zu %6ld x %2d %12.2f us (min) %8" PRIu64 " wrong\n", coll_op_name(r->op),
          r->bytes, r->iters, r->reps, best, r->wrong);
  fflush(f);
}
