/* mpi_coll -- the Open MPI reference for bench/coll_bench.py: every collective of the suite with
 * MPI's own implementation, sized, timed and checked exactly as commux_coll_bench and the
 * torch.distributed ranks do (coll_common.h).
 *
 *   mpirun -np N mpi_coll [--ops LIST] [--sizes LIST] [--reps N] ... [--json FILE]
 *
 * In-place forms where torch's are in place (allreduce, reduce at the root); broadcast and reduce
 * from root 0; p2p is a ring of MPI_Irecv + MPI_Isend. Exit status (rank 0): 0 all data correct,
 * 1 some element wrong, 2 the run failed. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "coll_common.h"

enum { kDataTag = 1 };

typedef struct {
  int rank;
  int n;
} mpi_ctx;

static void run(void* ctx, coll_op op, const coll_shape* s, float* in, float* out) {
  const mpi_ctx* c = (const mpi_ctx*)ctx;
  const int count = (int)s->count;
  const int chunk = (int)s->chunk;
  MPI_Request rq[2];
  switch (op) {
    case COLL_P2P:
      MPI_Irecv(out, count, MPI_FLOAT, (c->rank + c->n - 1) % c->n, kDataTag, MPI_COMM_WORLD,
                &rq[0]);
      MPI_Isend(in, count, MPI_FLOAT, (c->rank + 1) % c->n, kDataTag, MPI_COMM_WORLD, &rq[1]);
      MPI_Waitall(2, rq, MPI_STATUSES_IGNORE);
      break;
    case COLL_ALLREDUCE:
      MPI_Allreduce(MPI_IN_PLACE, in, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case COLL_BROADCAST: MPI_Bcast(in, count, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    case COLL_REDUCE:
      MPI_Reduce(c->rank == 0 ? MPI_IN_PLACE : in, c->rank == 0 ? in : NULL, count, MPI_FLOAT,
                 MPI_SUM, 0, MPI_COMM_WORLD);
      break;
    case COLL_ALLGATHER:
      MPI_Allgather(in, chunk, MPI_FLOAT, out, chunk, MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case COLL_REDUCE_SCATTER:
      MPI_Reduce_scatter_block(in, out, chunk, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case COLL_ALLTOALL:
      MPI_Alltoall(in, chunk, MPI_FLOAT, out, chunk, MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case COLL_BARRIER:
    case COLL_NOPS: MPI_Barrier(MPI_COMM_WORLD); break;
  }
}

static void barrier(void* ctx) {
  (void)ctx;
  MPI_Barrier(MPI_COMM_WORLD);
}

static void share_plan(void* ctx, long plan[2]) {
  (void)ctx;
  MPI_Bcast(plan, 2, MPI_LONG, 0, MPI_COMM_WORLD);
}

static void gather_results(void* ctx, double* times, int reps, uint64_t* wrong) {
  const mpi_ctx* c = (const mpi_ctx*)ctx;
  double maxima[COLL_MAX_REPS];
  uint64_t total = 0;
  MPI_Reduce(times, maxima, reps, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  MPI_Reduce(wrong, &total, 1, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  if (c->rank == 0) {
    memcpy(times, maxima, (size_t)reps * sizeof(double));
    *wrong = total;
  }
}

static float* alloc_floats(size_t count) {
  void* p = NULL;
  if (posix_memalign(&p, 4096, (count > 0 ? count : 1) * sizeof(float)) != 0) {
    fprintf(stderr, "mpi_coll: out of memory (%zu floats)\n", count);
    MPI_Abort(MPI_COMM_WORLD, COLL_EXIT_ERROR);
  }
  return (float*)p;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  mpi_ctx c;
  MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &c.n);
  coll_args a;
  if (coll_parse_args(&a, argc, argv, "mpi_coll") != 0) {
    MPI_Finalize();
    return COLL_EXIT_ERROR;
  }
  size_t max_count = 1;
  for (int s = 0; s < a.nsizes; ++s) {
    const coll_shape sh = coll_make_shape(COLL_ALLREDUCE, a.sizes[s], c.n);
    const coll_shape g = coll_make_shape(COLL_ALLGATHER, a.sizes[s], c.n);
    if (sh.count > (size_t)INT_MAX) {
      if (c.rank == 0) fprintf(stderr, "mpi_coll: size %zu is too large\n", a.sizes[s]);
      MPI_Finalize();
      return COLL_EXIT_ERROR;
    }
    if (sh.count > max_count) max_count = sh.count;
    if (g.count > max_count) max_count = g.count;
  }
  bench_arm_watchdog(a.timeout_s, c.rank == 0 ? "mpi_coll rank 0" : "mpi_coll rank > 0");
  float* in = alloc_floats(max_count);
  float* out = alloc_floats(max_count);
  const coll_backend b = {&c, c.rank, c.n, run, barrier, share_plan, gather_results};
  coll_row* rows = (coll_row*)calloc((size_t)(a.nops * a.nsizes), sizeof(coll_row));
  int nrows = 0;
  uint64_t wrong = 0;
  for (int o = 0; o < a.nops; ++o) {
    for (int s = 0; s < a.nsizes; ++s) {
      if (a.ops[o] == COLL_BARRIER && s > 0) break; /* one row: it moves no data */
      rows[nrows] = coll_run_size(&a, &b, a.ops[o], s, in, out);
      if (c.rank == 0) coll_print_row(stderr, &rows[nrows]);
      wrong += rows[nrows].wrong;
      ++nrows;
    }
  }
  int code = COLL_EXIT_OK;
  if (c.rank == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    while (len > 0 && (version[len - 1] == '\n' || version[len - 1] == ' ')) version[--len] = '\0';
    char* nl = strchr(version, '\n');
    if (nl != NULL) *nl = '\0';
    const char* info[] = {"mpi_library", version};
    if (coll_write_json(a.json_path, "mpi_coll", "mpi", c.n, info, 1, rows, nrows) != 0) {
      code = COLL_EXIT_ERROR;
    } else if (wrong > 0) {
      code = COLL_EXIT_WRONG;
    }
  }
  free(rows);
  free(out);
  free(in);
  MPI_Finalize();
  return code;
}
