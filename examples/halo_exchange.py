#!/usr/bin/env python3
"""halo_exchange.py -- commux's reference torch.distributed example: a 2-D Jacobi (heat) stencil
whose N x N grid is split over the ranks, with halos exchanged by tagged isend/irecv.

    torchrun --nproc-per-node=4 examples/halo_exchange.py [--n N] [--iters K] ...
    python examples/halo_exchange.py --nprocs 4 [...]        # starts its own ranks, no torchrun

Read it top to bottom; it shows how a program uses the "ucx" backend:
  * choosing the backend with the portable pattern (falls back to gloo without commux):
        try:
            from commux import preferred_backend
            backend = preferred_backend()          # registers "ucx" (and "commux"), returns "ucx"
        except ImportError:
            backend = "gloo"
  * two backends in one launch: the default group runs on the first backend of --backends, every
    other backend gets dist.new_group(backend=...). Point-to-point calls then name the group and
    the peer's rank *in that group*: dist.isend(t, group=g, group_dst=r, tag=...).
  * halo exchange: every rank owns a block of the grid plus a one-cell ghost frame. Each iteration
    it posts one dist.irecv and one dist.isend per neighbour, with one tag per direction the message
    travels (tag = 100 + direction), in a freshly shuffled order (seeded, different per rank), and
    only then waits for all of them: the backend matches messages on (sender, tag), not on the
    order operations were posted. Rows go straight from / into the grid (a row of a block is
    contiguous); columns are copied into contiguous buffers first.
    Blocking dist.send/dist.recv posted in different orders on two ranks may deadlock once messages
    are large enough for a rendezvous protocol, exactly as with MPI: post non-blocking operations
    first, then wait.
  * --overlap: post the halos, update the cells that need none while they travel, then wait and
    update the ring of cells next to the ghost frame (Solver.overlapped_step): the classic way to
    hide communication behind computation. The progress thread moves the posted transfers
    meanwhile; nothing is called on the backend between the posts and the waits.
  * every --check-every iterations the residual max |new - old| is combined with dist.all_reduce
    (ReduceOp.MAX, exact in any order).
  * verification: rank 0 gathers the grid (point-to-point) and compares it with a single-process
    solve of the same problem. Both use float64 and the same update expression, evaluated
    element by element in the same order, so the results must be bitwise identical; any difference
    (or a NaN from a halo that never arrived) is a mismatch.

The problem is the one examples/halo_demo.cpp solves with commux's C++ API (same start and
boundary values, same defaults): both print the residual 1.423801e-03 after 200 iterations.

Output (rank 0): time per iteration for each backend, the ratio to the last backend, and
"check: OK" or the mismatch with its maximum error. Exit status: 0 all backends agree with the
reference; 1 an error (a rank failed, hung or could not start); 2 a usage error; 3 a mismatch.
"""
import argparse
import datetime
import faulthandler
import os
import random
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MISMATCH = 0, 1, 2, 3
DEFAULT_BACKENDS = "ucx,gloo"

# Directions, named after where the neighbour lies. A message to the north neighbour travels north
# and is tagged 100 + NORTH; the north neighbour receives it from its south side with the same tag.
NORTH, SOUTH, EAST, WEST = 0, 1, 2, 3
OPPOSITE = {NORTH: SOUTH, SOUTH: NORTH, EAST: WEST, WEST: EAST}
TAG_HALO = 100     # + the direction the halo travels
TAG_GATHER = 200   # rank r -> rank 0: its block, at the end


def halo_tag(travel):
    return TAG_HALO + travel


# ------------------------------------------------------------------------------------------------
# Choosing backends

def fast_backend():
    """The portable pattern: commux's backend when commux is installed, else None."""
    try:
        from commux import preferred_backend
    except ImportError:
        return None
    return preferred_backend()  # registers "ucx" and "commux" in this process


def resolve_backends(text, explicit):
    """--backends as a list. "ucx"/"commux" need commux; without it they are dropped from the
    default list (with a note) and an error when asked for explicitly."""
    wanted = [b.strip() for b in text.split(",") if b.strip()]
    if not wanted or len(set(wanted)) != len(wanted):
        raise UsageError(f"--backends needs distinct backend names, got '{text}'")
    if not any(b in ("ucx", "commux") for b in wanted):
        return wanted, None
    if fast_backend() is not None:
        return wanted, None
    if explicit:
        raise UsageError("backend 'ucx' needs the commux package (import commux failed); "
                         "install it or pass --backends gloo")
    kept = [b for b in wanted if b not in ("ucx", "commux")] or ["gloo"]
    return kept, "commux is not installed: running " + ",".join(kept) + " only"


# ------------------------------------------------------------------------------------------------
# Decomposition: a px x py grid of ranks, each owning one rectangular block of cells.

def process_grid(n):
    """(px, py) with px * py == n, px >= py, as close as possible (4 -> 2x2, 3 -> 3x1, 6 -> 3x2)."""
    py = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return n // py, py


def split(n, parts, index):
    """Piece `index` of n cells split into `parts` near-equal pieces: (first, count)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def block_of(rank, n, px, py):
    """(x0, y0, nx, ny): the global coordinates of rank's first owned cell and its extent."""
    x0, nx = split(n, px, rank % px)
    y0, ny = split(n, py, rank // px)
    return x0, y0, nx, ny


def neighbour(rank, direction, px, py):
    """The rank on side `direction` of `rank`, or None at the edge of the domain."""
    cx, cy = rank % px, rank // px
    cx += {EAST: 1, WEST: -1}.get(direction, 0)
    cy += {SOUTH: 1, NORTH: -1}.get(direction, 0)
    return cy * px + cx if 0 <= cx < px and 0 <= cy < py else None


# ------------------------------------------------------------------------------------------------
# The problem: fixed boundary values around the grid, a rough start, Jacobi sweeps (float64).

def initial_grid(n):
    """The whole (n + 2) x (n + 2) grid with its boundary frame: a hot top edge (1.0), a warm west
    edge (0.5), the rest cold; inside, a rough start that is exact in binary."""
    g = torch.zeros(n + 2, n + 2, dtype=torch.float64)
    gy = torch.arange(n, dtype=torch.int64).view(-1, 1)
    gx = torch.arange(n, dtype=torch.int64).view(1, -1)
    g[1:-1, 1:-1] = ((gx * 7 + gy * 13) % 17).to(torch.float64) / 16.0
    g[1:-1, 0] = 0.5
    g[0, :] = 1.0
    return g


def sweep(cur, nxt, rows=slice(None), cols=slice(None)):
    """One Jacobi step over the cells inside the frame of `cur` (or the part of them that `rows`,
    `cols` select), written to `nxt`; returns max |new - old|, or None for no cell. The
    distributed run and the reference both use exactly this expression, so every cell is computed
    with the same operations in the same order, whichever part of the block a call covers."""
    def inner(t, dy, dx):  # the cells at offset (dy, dx) from each selected cell
        return t[1 + dy:t.shape[0] - 1 + dy, 1 + dx:t.shape[1] - 1 + dx][rows, cols]
    v = inner(cur, -1, 0) + inner(cur, 1, 0)   # north + south
    if v.numel() == 0:
        return None
    v += inner(cur, 0, -1)                     # + west
    v += inner(cur, 0, 1)                      # + east
    v *= 0.25
    residual = (v - inner(cur, 0, 0)).abs_().max()
    inner(nxt, 0, 0)[...] = v
    return residual


def reference_solve(n, iters):
    """The single-process solve rank 0 checks against: the whole grid as one block.
    Returns (grid without frame, residual after each iteration)."""
    cur = initial_grid(n)
    nxt = cur.clone()
    residuals = []
    for _ in range(iters):
        residuals.append(sweep(cur, nxt).item())
        cur, nxt = nxt, cur
    return cur[1:-1, 1:-1].clone(), residuals


# ------------------------------------------------------------------------------------------------
# One rank's part of the solve

class Side:
    """A neighbour: which way it lies, its rank in the group, and the column buffers."""

    def __init__(self, direction, peer, cells):
        self.direction, self.peer = direction, peer
        self.is_row = direction in (NORTH, SOUTH)
        self.send_col = None if self.is_row else torch.empty(cells, dtype=torch.float64)
        self.recv_col = None if self.is_row else torch.empty(cells, dtype=torch.float64)

    def edge(self, f):
        """The owned row / column next to this side (a view of f)."""
        return {NORTH: f[1, 1:-1], SOUTH: f[-2, 1:-1], WEST: f[1:-1, 1], EAST: f[1:-1, -2]}[
            self.direction]

    def ghost(self, f):
        """The ghost row / column beyond this side (a view of f)."""
        return {NORTH: f[0, 1:-1], SOUTH: f[-1, 1:-1], WEST: f[1:-1, 0], EAST: f[1:-1, -1]}[
            self.direction]


class Solver:
    """One rank's block, with a one-cell ghost frame, and its halo exchange on one group."""

    def __init__(self, args, group, rank, size):
        self.args, self.group, self.rank, self.size = args, group, rank, size
        self.px, self.py = process_grid(size)
        self.x0, self.y0, self.nx, self.ny = block_of(rank, args.n, self.px, self.py)
        self.sides = []
        for d in (NORTH, SOUTH, EAST, WEST):
            peer = neighbour(rank, d, self.px, self.py)
            if peer is not None:
                self.sides.append(Side(d, peer, self.nx if d in (NORTH, SOUTH) else self.ny))

    def fresh_fields(self):
        """(cur, nxt): the block and frame cut from the initial grid; frame cells that a neighbour
        provides start as NaN, so a halo that never arrives poisons the result visibly."""
        whole = initial_grid(self.args.n)
        cur = whole[self.y0:self.y0 + self.ny + 2, self.x0:self.x0 + self.nx + 2].clone()
        for s in self.sides:
            s.ghost(cur).fill_(float("nan"))
        return cur, cur.clone()

    def exchange(self, f, rng):
        """Fills the ghost frame of f from the neighbours."""
        self.finish_exchange(f, self.post_exchange(f, rng))

    def post_exchange(self, f, rng):
        """Posts the halo exchange of f; returns its Works. Until finish_exchange, the ghost frame
        and the edge cells of f are in transit: read neither, write neither."""
        for s in self.sides:
            if not s.is_row:
                s.send_col.copy_(s.edge(f))
        posts = [(s, is_send) for s in self.sides for is_send in (False, True)]
        rng.shuffle(posts)
        works = []
        for s, is_send in posts:
            if is_send:  # travels towards the neighbour
                buf = s.edge(f) if s.is_row else s.send_col
                works.append(dist.isend(buf, group=self.group, group_dst=s.peer,
                                        tag=halo_tag(s.direction)))
            else:        # sent by the neighbour towards us
                buf = s.ghost(f) if s.is_row else s.recv_col
                works.append(dist.irecv(buf, group=self.group, group_src=s.peer,
                                        tag=halo_tag(OPPOSITE[s.direction])))
        return works

    def finish_exchange(self, f, works):
        """Waits for the Works of post_exchange and completes f's ghost frame."""
        for w in works:
            w.wait()
        for s in self.sides:
            if not s.is_row:
                s.ghost(f).copy_(s.recv_col)

    def solve(self, iters):
        """Runs `iters` iterations from the initial grid. Returns (owned cells, the all-reduced
        residuals {iteration: value}, seconds the loop took on this rank)."""
        cur, nxt = self.fresh_fields()
        rng = random.Random(self.args.seed * 1_000_003 + self.rank)  # same order for every backend
        residuals = {}
        local = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)  # start together
        start = time.perf_counter()
        for it in range(iters):
            if self.args.overlap:
                local[0] = self.overlapped_step(cur, nxt, rng)
            else:
                self.exchange(cur, rng)
                local[0] = sweep(cur, nxt)
            cur, nxt = nxt, cur
            if (it + 1) % self.args.check_every == 0 or it + 1 == iters:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
                residuals[it] = local.item()
        return cur[1:-1, 1:-1].contiguous(), residuals, time.perf_counter() - start

    def overlapped_step(self, cur, nxt, rng):
        """--overlap: posts the exchange, updates the cells whose neighbours are all owned (no
        halo needed) while the halos travel, then waits and updates the ring of cells next to
        the frame. Returns the step's max |new - old|, the same value sweep(cur, nxt) gives."""
        works = self.post_exchange(cur, rng)
        parts = [sweep(cur, nxt, slice(1, -1), slice(1, -1))]
        self.finish_exchange(cur, works)
        parts += [sweep(cur, nxt, slice(0, 1)), sweep(cur, nxt, slice(-1, None)),
                  sweep(cur, nxt, slice(1, -1), slice(0, 1)),
                  sweep(cur, nxt, slice(1, -1), slice(-1, None))]
        return max(p for p in parts if p is not None)

    def gather(self, block):
        """The whole grid at rank 0 (None elsewhere), over point-to-point on this group."""
        if self.rank != 0:
            dist.isend(block, group=self.group, group_dst=0, tag=TAG_GATHER).wait()
            return None
        grid = torch.full((self.args.n, self.args.n), float("nan"), dtype=torch.float64)
        parts, works = {}, []
        for r in range(1, self.size):
            _, _, nx, ny = block_of(r, self.args.n, self.px, self.py)
            parts[r] = torch.empty(ny, nx, dtype=torch.float64)
            works.append(dist.irecv(parts[r], group=self.group, group_src=r, tag=TAG_GATHER))
        for w in works:
            w.wait()
        parts[0] = block
        for r, cells in parts.items():
            x0, y0, nx, ny = block_of(r, self.args.n, self.px, self.py)
            grid[y0:y0 + ny, x0:x0 + nx] = cells
        return grid


def compare(grid, residuals, reference):
    """(ok, text): the gathered grid and residuals against the single-process solve."""
    ref_grid, ref_res = reference
    bitwise = torch.equal(grid, ref_grid)  # NaN never equals anything
    diff = (grid - ref_grid).abs()
    max_err = float("inf") if diff.isnan().any() else diff.max().item()
    bad_res = [(it, v, ref_res[it]) for it, v in residuals.items() if v != ref_res[it]]
    if bitwise and not bad_res:
        return True, "check: OK (bitwise identical to the single-process solve)"
    text = (f"check: MISMATCH: max |distributed - reference| = {max_err:.3g}, "
            f"{int((grid != ref_grid).sum())} of {grid.numel()} cells differ")
    if bad_res:
        it, v, r = bad_res[0]
        text += (f"; {len(bad_res)} residual(s) differ, first after iteration {it + 1}: "
                 f"{v!r} vs {r!r}")
    return False, text


# ------------------------------------------------------------------------------------------------
# One rank: every backend in turn

def run_rank(args, backends, note):
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # ranks share the cores; intra-op threads would only compete
    if "ucx" in backends or "commux" in backends:
        fast_backend()  # registration is per process
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend=backends[0], init_method="env://", timeout=timeout)
    groups = {backends[0]: dist.group.WORLD}
    for b in backends[1:]:  # every rank creates the groups in the same order
        groups[b] = dist.new_group(backend=b, timeout=timeout)

    px, py = process_grid(size)
    if rank == 0:
        ranks = f"{size} rank" + ("s" if size > 1 else "")
        print(f"halo_exchange: {args.n}x{args.n} grid, {args.iters} iterations, {ranks} as "
              f"{px}x{py} blocks{', overlapped' if args.overlap else ''}, residual all-reduced every "
              f"{args.check_every}, seed {args.seed}, "
              f"backends {','.join(backends)}", flush=True)
        if note:
            print(f"halo_exchange: note: {note}", flush=True)

    reference = None
    ok = True
    per_iter = {}
    for b in backends:
        solver = Solver(args, groups[b], dist.get_group_rank(groups[b], rank), size)
        if args.warmup:
            solver.solve(min(args.warmup, args.iters))  # connections, allocations, caches
        block, residuals, seconds = solver.solve(args.iters)
        grid = solver.gather(block)
        if rank == 0:
            if reference is None:
                reference = reference_solve(args.n, args.iters)
            good, text = compare(grid, residuals, reference)
            ok &= good
            per_iter[b] = seconds / args.iters
            final = residuals[args.iters - 1]
            print(f"halo_exchange: {b:>6}: {per_iter[b] * 1e3:8.3f} ms per iteration "
                  f"({args.iters} in {seconds:.3f} s on rank 0), residual {final:.6e}, {text}",
                  flush=True)
    if rank == 0 and len(per_iter) > 1:
        base = backends[-1]
        for b in backends[:-1]:
            print(f"halo_exchange: time per iteration {b}/{base} = "
                  f"{per_iter[b] / per_iter[base]:.2f}", flush=True)

    # Every rank learns rank 0's verdict (so every exit status reflects it); this is also the last
    # collective, so no rank tears down while another still talks to it.
    verdict = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return EXIT_OK if verdict.item() == 0 else EXIT_MISMATCH


class UsageError(Exception):
    pass


def rank_main(args, backends, note):
    """Runs one rank; returns its exit status. A rank that hangs past the timeout dumps every
    thread's stack and exits."""
    faulthandler.dump_traceback_later(args.timeout + 30, exit=True)
    rank = os.environ.get("RANK", "?")
    try:
        return run_rank(args, backends, note)
    except UsageError as e:
        print(f"halo_exchange: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 -- report which rank failed and how
        print(f"halo_exchange: rank {rank}: error:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        return EXIT_FAILED


# ------------------------------------------------------------------------------------------------
# Launching: under torchrun, or spawning --nprocs ranks ourselves

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned_rank(rank, nprocs, port, args, backends, note):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    sys.exit(rank_main(args, backends, note))


def spawn(args, backends, note):
    """Starts args.nprocs ranks, waits for them (killing all after a failure or the deadline)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=spawned_rank, args=(r, args.nprocs, port, args, backends, note))
             for r in range(args.nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout + 60
    failed_at = None
    while any(p.exitcode is None for p in procs):
        time.sleep(0.05)
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now  # give the others a moment to report their own errors
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join()
            break
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return EXIT_OK
    print("halo_exchange: FAILED: " + "; ".join(
        f"rank {r} " + ("killed" if c is not None and c < 0 else f"exited with status {c}")
        for r, c in enumerate(codes) if c != 0), file=sys.stderr)
    if all(c in (0, EXIT_MISMATCH) for c in codes):
        return EXIT_MISMATCH
    return EXIT_USAGE if EXIT_USAGE in codes else EXIT_FAILED


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="2-D Jacobi stencil with tagged halo exchange over torch.distributed, on "
                    "'ucx' (commux) and 'gloo' in one launch, checked against a single-process "
                    "solve.")
    p.add_argument("--n", type=int, default=512, help="grid cells per side (default 512)")
    p.add_argument("--iters", type=int, default=200, help="Jacobi iterations (default 200)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated backends, run in this order (default {DEFAULT_BACKENDS}; "
                        "ucx is left out with a note when commux is not installed)")
    p.add_argument("--check-every", type=int, default=20,
                   help="all-reduce the residual every this many iterations (default 20)")
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed iterations per backend before the timed solve (default 10)")
    p.add_argument("--overlap", action="store_true",
                   help="post the halos, update the cells that need none while they travel, then "
                        "wait and update the rest (default: wait, then update every cell)")
    p.add_argument("--seed", type=int, default=2024,
                   help="rank r shuffles its posting order with a generator seeded from seed, r")
    p.add_argument("--nprocs", type=int, default=None,
                   help="without torchrun: start this many local ranks (default 4)")
    p.add_argument("--timeout", type=int, default=120,
                   help="seconds before a stuck operation fails / the ranks are killed")
    args = p.parse_args(argv)
    for name in ("n", "iters", "check_every", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.nprocs is not None and not 1 <= args.nprocs <= 64:
        p.error("--nprocs must be between 1 and 64")
    return p, args


def main(argv):
    parser, args = parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # local ranks: loopback unless the user chose
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and args.nprocs is not None:
        parser.error("--nprocs is for running without torchrun (torchrun sets the world size)")
    try:
        backends, note = resolve_backends(args.backends or DEFAULT_BACKENDS,
                                          explicit=args.backends is not None)
    except UsageError as e:
        parser.error(str(e))
    if not under_torchrun and args.nprocs is None:
        args.nprocs = 4
    px, py = process_grid(int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nprocs)
    if args.n < px:
        parser.error(f"a {args.n}x{args.n} grid cannot be split over {px}x{py} ranks")
    if under_torchrun:
        return rank_main(args, backends, note)
    return spawn(args, backends, note)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
