/* mpi_pingpong -- the reference for commux_bench --mode pingpong: the same sizes, iteration plans,
 * data pattern, checks and output (mode "mpi_pingpong"), with MPI_Send / MPI_Recv.
 *
 *   mpirun -np 2 mpi_pingpong [--sizes LIST] [--reps N] [--quick] [--timeout SEC] [--json FILE]
 *
 * Exit status (rank 0): 0 all data correct, 1 some byte wrong, 2 the run failed. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"

enum { kDataTag = 1, kSyncTag = 2, kResultTag = 3 };

static unsigned char* alloc_slab(size_t bytes) {
  void* p = NULL;
  if (bytes > 0 && posix_memalign(&p, 4096, bytes) != 0) {
    fprintf(stderr, "mpi_pingpong: out of memory (%zu bytes)\n", bytes);
    MPI_Abort(MPI_COMM_WORLD, BENCH_EXIT_ERROR);
  }
  return (unsigned char*)p;
}

static void send_bytes(void* buf, size_t size, int peer, int tag) {
  MPI_Send(buf, (int)size, MPI_BYTE, peer, tag, MPI_COMM_WORLD);
}

static void recv_bytes(void* buf, size_t size, int peer, int tag) {
  MPI_Recv(buf, (int)size, MPI_BYTE, peer, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}

/* One repetition on rank 0; returns the one-way time per message in µs. */
static double pingpong_rank0(const bench_plan* p, int rep, unsigned char* out, unsigned char* back,
                             uint64_t* wrong) {
  bench_fill_slab(out, p, rep);
  bench_poison(back, p->size * (size_t)p->slots);
  recv_bytes(NULL, 0, 1, kSyncTag); /* rank 1 is ready */
  const int stamp = p->slots < p->iters;
  const double t0 = bench_now_us();
  for (long i = 0; i < p->iters; ++i) {
    void* o = bench_slot(out, p, i);
    if (stamp) bench_stamp(o, p->size, bench_key(rep, i));
    send_bytes(o, p->size, 1, kDataTag);
    void* r = bench_slot(back, p, i);
    recv_bytes(r, p->size, 1, kDataTag);
    if (stamp) *wrong += bench_check_edges(r, p->size, bench_key(rep, i));
  }
  const double t1 = bench_now_us();
  *wrong += bench_check_slab(back, p, rep);
  return (t1 - t0) / (2.0 * (double)p->iters);
}

static void pingpong_rank1(const bench_plan* p, int rep, unsigned char* in, uint64_t* wrong) {
  bench_poison(in, p->size * (size_t)p->slots);
  send_bytes(NULL, 0, 0, kSyncTag);
  const int stamp = p->slots < p->iters;
  for (long i = 0; i < p->iters; ++i) {
    void* m = bench_slot(in, p, i);
    recv_bytes(m, p->size, 0, kDataTag);
    if (stamp) *wrong += bench_check_edges(m, p->size, bench_key(rep, i));
    send_bytes(m, p->size, 0, kDataTag); /* echo */
  }
  *wrong += bench_check_slab(in, p, rep);
}

/* One size: a warm-up repetition, then p.reps timed ones; rank 0's row counts both ranks' wrong
 * bytes. */
static bench_row run_size(const bench_args* a, int rank, size_t size) {
  const bench_plan p = bench_make_plan(a, size, BENCH_P2P_REP_BYTES, BENCH_P2P_MAX_ITERS, 1);
  unsigned char* slab = alloc_slab(p.size * (size_t)p.slots);
  unsigned char* back = rank == 0 ? alloc_slab(p.size * (size_t)p.slots) : NULL;
  double* samples = (double*)calloc((size_t)p.reps, sizeof(double));
  uint64_t wrong = 0;
  for (int rep = 0; rep <= p.reps; ++rep) {
    if (rank == 0) {
      const double us = pingpong_rank0(&p, rep, slab, back, &wrong);
      if (rep > 0) samples[rep - 1] = us;
    } else {
      pingpong_rank1(&p, rep, slab, &wrong);
    }
  }
  bench_row row;
  memset(&row, 0, sizeof(row));
  if (rank == 1) {
    send_bytes(&wrong, sizeof(wrong), 0, kResultTag);
  } else {
    uint64_t peer_wrong = 0;
    recv_bytes(&peer_wrong, sizeof(peer_wrong), 1, kResultTag);
    row.mode = "mpi_pingpong";
    row.size = p.size;
    row.iters = p.iters;
    row.reps = p.reps;
    bench_summarize(samples, p.reps, &row.time_us_median, &row.time_us_min);
    row.gbps = (double)p.size / (row.time_us_median * 1e3);
    row.wrong = wrong + peer_wrong;
  }
  free(samples);
  free(back);
  free(slab);
  return row;
}

/* 0 on success; a message on rank 0 otherwise. */
static int parse_args(int argc, char** argv, int rank, bench_args* a) {
  bench_args_init(a);
  for (int i = 1; i < argc; ++i) {
    const int rc = bench_parse_common(a, argc, argv, &i);
    if (rc > 0) continue;
    if (rc == 0 && rank == 0) {
      fprintf(stderr, "mpi_pingpong: unknown flag '%s'\n", argv[i]);
      fprintf(stderr, "usage: mpirun -np 2 mpi_pingpong [options]\n%s", bench_common_usage());
    }
    return -1;
  }
  for (int s = 0; s < a->nsizes; ++s) {
    if (a->sizes[s] > (size_t)INT_MAX) {
      if (rank == 0) fprintf(stderr, "mpi_pingpong: size %zu is over INT_MAX\n", a->sizes[s]);
      return -1;
    }
  }
  return 0;
}

static int report(const bench_args* a, const bench_row* rows) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  while (len > 0 && (version[len - 1] == '\n' || version[len - 1] == ' ')) version[--len] = '\0';
  const bench_kv info[] = {{"mpi_library", version}};
  if (bench_write_json(a->json_path, "mpi_pingpong", info, 1, rows, a->nsizes) != 0) {
    return BENCH_EXIT_ERROR;
  }
  for (int s = 0; s < a->nsizes; ++s) {
    if (rows[s].wrong > 0) return BENCH_EXIT_WRONG;
  }
  return BENCH_EXIT_OK;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  bench_args a;
  if (parse_args(argc, argv, rank, &a) != 0 || size != 2) {
    if (rank == 0 && size != 2) fprintf(stderr, "mpi_pingpong: needs 2 ranks, got %d\n", size);
    MPI_Finalize();
    return BENCH_EXIT_ERROR;
  }
  bench_arm_watchdog(a.timeout_s, rank == 0 ? "mpi_pingpong rank 0" : "mpi_pingpong rank 1");
  if (rank == 0) bench_print_header(stderr);
  bench_row rows[BENCH_MAX_SIZES];
  for (int s = 0; s < a.nsizes; ++s) {
    rows[s] = run_size(&a, rank, a.sizes[s]);
    if (rank == 0) bench_print_row(stderr, &rows[s]);
  }
  const int code = rank == 0 ? report(&a, rows) : BENCH_EXIT_OK;
  MPI_Finalize();
  return code;
}
