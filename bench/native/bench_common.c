#define _POSIX_C_SOURCE 200809L
#include "bench_common.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const size_t kDefaultSizes[] = {8,         64,       512,      4 << 10,   64 << 10,
                                       256 << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
enum { kDefaultReps = 9, kQuickReps = 3, kQuickDivisor = 8, kDefaultTimeoutS = 120 };
static const uint64_t kGolden = 0x9E3779B97F4A7C15ull;
static const unsigned char kPoison = 0xA5;

/* ---------------------------------------------------------------------------------------------
 * Flags */

void bench_args_init(bench_args* a) {
  memset(a, 0, sizeof(*a));
  a->nsizes = (int)(sizeof(kDefaultSizes) / sizeof(kDefaultSizes[0]));
  memcpy(a->sizes, kDefaultSizes, sizeof(kDefaultSizes));
  a->timeout_s = kDefaultTimeoutS;
}

const char* bench_common_usage(void) {
  return "  --sizes LIST    message sizes, e.g. 8,4K,1M\n"
         "                  (default 8,64,512,4K,64K,256K,1M,4M,16M,64M)\n"
         "  --reps N        timed repetitions per size, after a warm-up (default 9; --quick 3)\n"
         "  --quick         an eighth of the iterations (smoke test)\n"
         "  --timeout SEC   watchdog for the whole run (default 120)\n"
         "  --json FILE     write the JSON there instead of stdout\n";
}

size_t bench_parse_size(const char* text, const char** end) {
  char* stop = NULL;
  errno = 0;
  const unsigned long long v = strtoull(text, &stop, 10);
  if (stop == text || errno != 0) return 0;
  unsigned shift = 0;
  switch (toupper((unsigned char)*stop)) {
    case 'K':
      shift = 10;
      ++stop;
      break;
    case 'M':
      shift = 20;
      ++stop;
      break;
    case 'G':
      shift = 30;
      ++stop;
      break;
    default: break;
  }
  *end = stop;
  return (size_t)(v << shift);
}

static int parse_sizes(bench_args* a, const char* text) {
  a->nsizes = 0;
  const char* p = text;
  while (*p != '\0') {
    const char* end = p;
    const size_t s = bench_parse_size(p, &end);
    if (s == 0 || (*end != ',' && *end != '\0') || a->nsizes == BENCH_MAX_SIZES) {
      fprintf(stderr, "--sizes '%s': want up to %d sizes > 0 like 8,4K,1M\n", text,
              BENCH_MAX_SIZES);
      return -1;
    }
    a->sizes[a->nsizes++] = s;
    p = *end == ',' ? end + 1 : end;
  }
  return a->nsizes > 0 ? 1 : -1;
}

static int parse_positive(const char* flag, const char* text, int* out) {
  char* end = NULL;
  const long v = strtol(text, &end, 10);
  if (end == text || *end != '\0' || v <= 0 || v > 1000000) {
    fprintf(stderr, "%s '%s': want a positive integer\n", flag, text);
    return -1;
  }
  *out = (int)v;
  return 1;
}

int bench_parse_common(bench_args* a, int argc, char** argv, int* i) {
  const char* flag = argv[*i];
  if (strcmp(flag, "--quick") == 0) {
    a->quick = 1;
    return 1;
  }
  const int takes_value = strcmp(flag, "--sizes") == 0 || strcmp(flag, "--reps") == 0 ||
                          strcmp(flag, "--timeout") == 0 || strcmp(flag, "--json") == 0;
  if (!takes_value) return 0;
  if (*i + 1 >= argc) {
    fprintf(stderr, "%s needs a value\n", flag);
    return -1;
  }
  const char* value = argv[++*i];
  if (strcmp(flag, "--sizes") == 0) return parse_sizes(a, value);
  if (strcmp(flag, "--reps") == 0) return parse_positive(flag, value, &a->reps);
  if (strcmp(flag, "--timeout") == 0) return parse_positive(flag, value, &a->timeout_s);
  a->json_path = value;
  return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Plans */

static long clamp_long(long v, long lo, long hi) { return v < lo ? lo : (v > hi ? hi : v); }

static void set_iters(bench_plan* p, long iters, long window) {
  p->iters = iters;
  p->window = clamp_long(window, 1, iters);
  p->slots = clamp_long((long)(BENCH_SLAB_BYTES / p->size), p->window, iters);
}

bench_plan bench_make_plan(const bench_args* a, size_t size, size_t rep_bytes, long max_iters,
                           long window) {
  bench_plan p;
  const long divisor = a->quick ? kQuickDivisor : 1;
  const long cap = clamp_long(max_iters / divisor, BENCH_MIN_ITERS, max_iters);
  p.size = size;
  p.reps = a->reps > 0 ? a->reps : (a->quick ? kQuickReps : kDefaultReps);
  set_iters(&p, clamp_long((long)(rep_bytes / (size_t)divisor / size), BENCH_MIN_ITERS, cap),
            window);
  return p;
}

void bench_limit_iters(bench_plan* p, long iters) {
  set_iters(p, clamp_long(iters, BENCH_MIN_ITERS, p->iters), p->window);
}

/* ---------------------------------------------------------------------------------------------
 * Data pattern */

static uint64_t mix64(uint64_t x) { /* splitmix64's finaliser */
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t bench_key(int rep, long iter) { return ((uint64_t)(uint32_t)rep << 32) | (uint32_t)iter; }

static uint64_t base_of(uint64_t key, size_t size) { return mix64(key ^ mix64(size)); }

static uint64_t word_at(uint64_t base, size_t word) { return base ^ ((uint64_t)word * kGolden); }

static unsigned char byte_at(uint64_t base, size_t index) {
  const uint64_t w = word_at(base, index / 8);
  unsigned char b[8];
  memcpy(b, &w, sizeof(b));
  return b[index % 8];
}

/* Writes the pattern into bytes [lo, hi) of buf. */
static void fill_range(unsigned char* buf, size_t lo, size_t hi, uint64_t base) {
  size_t i = lo;
  for (; i < hi && i % 8 != 0; ++i) buf[i] = byte_at(base, i);
  for (; i + 8 <= hi; i += 8) {
    const uint64_t w = word_at(base, i / 8);
    memcpy(buf + i, &w, sizeof(w));
  }
  for (; i < hi; ++i) buf[i] = byte_at(base, i);
}

static uint64_t wrong_bytes(uint64_t got, uint64_t want) {
  uint64_t n = 0;
  for (uint64_t d = got ^ want; d != 0; d >>= 8) n += (d & 0xFF) != 0;
  return n;
}

/* Wrong bytes among [lo, hi) of buf. */
static uint64_t check_range(const unsigned char* buf, size_t lo, size_t hi, uint64_t base) {
  uint64_t wrong = 0;
  size_t i = lo;
  for (; i < hi && i % 8 != 0; ++i) wrong += buf[i] != byte_at(base, i);
  for (; i + 8 <= hi; i += 8) {
    uint64_t got;
    memcpy(&got, buf + i, sizeof(got));
    const uint64_t want = word_at(base, i / 8);
    if (got != want) wrong += wrong_bytes(got, want);
  }
  for (; i < hi; ++i) wrong += buf[i] != byte_at(base, i);
  return wrong;
}

/* The edges are [0, head) and [tail, size); the body is between them. */
static size_t edge_head(size_t size) { return size < 8 ? size : 8; }
static size_t edge_tail(size_t size) {
  const size_t head = edge_head(size);
  return size - head > head ? size - head : head;
}

void bench_fill(void* buf, size_t size, uint64_t key) {
  fill_range((unsigned char*)buf, 0, size, base_of(key, size));
}

void bench_stamp(void* buf, size_t size, uint64_t key) {
  const uint64_t base = base_of(key, size);
  fill_range((unsigned char*)buf, 0, edge_head(size), base);
  fill_range((unsigned char*)buf, edge_tail(size), size, base);
}

void bench_poison(void* buf, size_t size) { memset(buf, kPoison, size); }

uint64_t bench_check_edges(const void* buf, size_t size, uint64_t key) {
  const uint64_t base = base_of(key, size);
  return check_range((const unsigned char*)buf, 0, edge_head(size), base) +
         check_range((const unsigned char*)buf, edge_tail(size), size, base);
}

uint64_t bench_check(const void* buf, size_t size, uint64_t body_key, uint64_t edge_key) {
  return bench_check_edges(buf, size, edge_key) + check_range((const unsigned char*)buf,
                                                              edge_head(size), edge_tail(size),
                                                              base_of(body_key, size));
}

void* bench_slot(void* slab, const bench_plan* p, long iter) {
  return (unsigned char*)slab + (size_t)(iter % p->slots) * p->size;
}

void bench_fill_slab(void* slab, const bench_plan* p, int rep) {
  for (long s = 0; s < p->slots; ++s) {
    bench_fill(bench_slot(slab, p, s), p->size, bench_key(rep, s));
  }
}

uint64_t bench_check_slab(const void* slab, const bench_plan* p, int rep) {
  uint64_t wrong = 0;
  for (long s = 0; s < p->slots; ++s) {
    const long last = s + (p->iters - 1 - s) / p->slots * p->slots; /* last iteration in slot s */
    const void* msg = (const unsigned char*)slab + (size_t)s * p->size;
    wrong += bench_check(msg, p->size, bench_key(rep, s), bench_key(rep, last));
  }
  return wrong;
}

/* ---------------------------------------------------------------------------------------------
 * Time, statistics, watchdog */

double bench_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int compare_double(const void* a, const void* b) {
  const double x = *(const double*)a;
  const double y = *(const double*)b;
  return (x > y) - (x < y);
}

void bench_summarize(double* samples, int n, double* median, double* min) {
  qsort(samples, (size_t)n, sizeof(double), compare_double);
  *min = samples[0];
  *median = n % 2 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
}

static char watchdog_message[256];

static void watchdog_fired(int sig) {
  (void)sig;
  const ssize_t w = write(STDERR_FILENO, watchdog_message, strlen(watchdog_message));
  (void)w;
  _exit(BENCH_EXIT_ERROR);
}

void bench_arm_watchdog(int seconds, const char* who) {
  snprintf(watchdog_message, sizeof(watchdog_message),
           "%s: watchdog: still running after %d s, giving up\n", who, seconds);
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = watchdog_fired;
  sigaction(SIGALRM, &sa, NULL);
  alarm((unsigned)seconds);
}

/* ---------------------------------------------------------------------------------------------
 * Output */

void bench_print_header(FILE* f) {
  fprintf(f, "#%11s %10s %8s %14s %14s %10s %8s\n", "mode", "size", "iters", "time_us(med)",
          "time_us(min)", "GB/s", "wrong");
}

void bench_print_row(FILE* f, const bench_row* r) {
  fprintf(f, "%12s %10zu %8ld %14.3f %14.3f %10.3f %8" PRIu64 "\n", r->mode, r->size, r->iters,
          r->time_us_median, r->time_us_min, r->gbps, r->wrong);
  fflush(f);
}

void bench_json_string(FILE* f, const char* s) {
  fputc('"', f);
  for (; *s != '\0'; ++s) {
    const unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      fprintf(f, "\\%c", c);
    } else if (c < 0x20) {
      fprintf(f, "\\u%04x", c);
    } else {
      fputc(c, f);
    }
  }
  fputc('"', f);
}

static void json_row(FILE* f, const bench_row* r) {
  fputs("{\"mode\": ", f);
  bench_json_string(f, r->mode);
  fprintf(f,
          ", \"size\": %zu, \"iters\": %ld, \"reps\": %d, \"time_us_median\": %.6g, "
          "\"time_us_min\": %.6g, \"gbps\": %.6g, \"wrong\": %" PRIu64 "}",
          r->size, r->iters, r->reps, r->time_us_median, r->time_us_min, r->gbps, r->wrong);
}

FILE* bench_json_open(const char* path, const char* program) {
  FILE* f = path != NULL ? fopen(path, "w") : stdout;
  if (f == NULL) {
    fprintf(stderr, "%s: cannot write %s: %s\n", program, path, strerror(errno));
    return NULL;
  }
  fputs("{\"program\": ", f);
  bench_json_string(f, program);
  return f;
}

int bench_write_json(const char* path, const char* program, const bench_kv* info, int ninfo,
                     const bench_row* rows, int nrows) {
  FILE* f = bench_json_open(path, program);
  if (f == NULL) return -1;
  fputs(", \"info\": {", f);
  for (int i = 0; i < ninfo; ++i) {
    fputs(i > 0 ? ", " : "", f);
    bench_json_string(f, info[i].key);
    fputs(": ", f);
    bench_json_string(f, info[i].value);
  }
  fputs("}, \"rows\": [", f);
  for (int i = 0; i < nrows; ++i) {
    fputs(i > 0 ? ",\n  " : "\n  ", f);
    json_row(f, &rows[i]);
  }
  fputs("]}\n", f);
  const int failed = ferror(f) != 0;
  if (path != NULL ? fclose(f) != 0 : fflush(f) != 0) return -1;
  return failed ? -1 : 0;
}
