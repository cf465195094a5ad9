// commux_halo_demo -- commux's reference "main job": a 2-D Jacobi heat stencil whose grid is split
// over N local ranks, with halo exchange over commux point-to-point.
//
// Read it top to bottom; it shows how a program uses commux:
//   * launching: the program forks its own N ranks; each builds a FileStore in one shared fresh
//     directory and a commux::Communicator(store, rank, N). UCX_NET_DEVICES defaults to "lo".
//   * halo exchange: non-blocking isend/irecv with tags that encode the direction a message
//     travels (plus the iteration parity). Every iteration the receives and sends are posted in a
//     freshly shuffled order: commux matches on (sender, tag), never on posting order.
//   * multi-buffer messages: every halo is one message of two buffers, {header, cells}. North and
//     south rows are sent from and received into the grid itself (no copy); east and west columns
//     are packed into contiguous buffers first. The receiver checks the header's iteration.
//   * a reduction built from point-to-point on purpose (commux::coll::allreduce does it in one
//     call; this exercises receive-from-any): the residual max |new - old| is
//     gathered at rank 0 with kAnySource receives -- Request::source() must name each other rank
//     exactly once -- and the maximum is sent back.
//   * verification: rank 0 gathers the grid and compares it with a single-process solve of the
//     same problem (the same arithmetic, so the results must agree bitwise).
//
// Usage: commux_halo_demo [--ranks N] [--nx NX] [--ny NY] [--iters K] [--residual-every R]
//                         [--seed S] [--timeout SECONDS]
// Exit code 0 when every rank succeeded and the grids agree; 1 otherwise; 2 for a usage error.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "commux/communicator.hpp"
#include "commux/store.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Configuration

struct Config {
  int ranks = 4;
  int nx = 512;  // grid columns (x grows to the east)
  int ny = 512;  // grid rows (y grows to the south; row 0 touches the hot top edge)
  int iters = 200;
  int residual_every = 20;  // combine the residual across ranks every this many iterations
  unsigned seed = 2024;     // rank r shuffles its posting order with seed + r
  int timeout_s = 120;      // the parent kills every rank still running after this
};

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitMismatch = 3;  // the distributed grid does not match the reference
constexpr int kExitWatchdog = 124;

[[noreturn]] void usage(const std::string& problem, int code = kExitUsage) {
  std::fprintf(code == kExitOk ? stdout : stderr,
               "commux_halo_demo: %s\n"
               "usage: commux_halo_demo [--ranks N] [--nx NX] [--ny NY] [--iters K]\n"
               "                        [--residual-every R] [--seed S] [--timeout SECONDS]\n",
               problem.c_str());
  std::exit(code);
}

int parse_int(const std::string& flag, const char* text, int min) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < min || v > std::numeric_limits<int>::max()) {
    usage(flag + " needs an integer >= " + std::to_string(min) + ", got '" + text + "'");
  }
  return static_cast<int>(v);
}

Config parse_args(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("a 2-D Jacobi demo of commux", kExitOk);
    if (i + 1 >= argc) usage("missing value after " + flag);
    const char* value = argv[++i];
    if (flag == "--ranks") c.ranks = parse_int(flag, value, 1);
    else if (flag == "--nx") c.nx = parse_int(flag, value, 1);
    else if (flag == "--ny") c.ny = parse_int(flag, value, 1);
    else if (flag == "--iters") c.iters = parse_int(flag, value, 1);
    else if (flag == "--residual-every") c.residual_every = parse_int(flag, value, 1);
    else if (flag == "--seed") c.seed = static_cast<unsigned>(parse_int(flag, value, 0));
    else if (flag == "--timeout") c.timeout_s = parse_int(flag, value, 1);
    else usage("unknown option " + flag);
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Decomposition: a px x py grid of ranks, each owning one rectangular block of cells.

enum class Dir : int { kNorth = 1, kSouth = 2, kEast = 3, kWest = 4 };
constexpr Dir kAllDirs[] = {Dir::kNorth, Dir::kSouth, Dir::kEast, Dir::kWest};

Dir opposite(Dir d) {
  switch (d) {
    case Dir::kNorth: return Dir::kSouth;
    case Dir::kSouth: return Dir::kNorth;
    case Dir::kEast: return Dir::kWest;
    case Dir::kWest: return Dir::kEast;
  }
  return d;
}

const char* dir_name(Dir d) {
  switch (d) {
    case Dir::kNorth: return "north";
    case Dir::kSouth: return "south";
    case Dir::kEast: return "east";
    case Dir::kWest: return "west";
  }
  return "?";
}

struct ProcessGrid {
  int px = 1;  // ranks along x
  int py = 1;  // ranks along y; rank = cy * px + cx, cy = 0 is the top row of ranks

  // px * py == n with px >= py and the two as close as possible (6 -> 3x2, 3 -> 3x1).
  static ProcessGrid for_ranks(int n) {
    ProcessGrid g;
    for (int d = 1; d * d <= n; ++d) {
      if (n % d == 0) g.py = d;
    }
    g.px = n / g.py;
    return g;
  }

  // The rank on side `d` of `rank`, or -1 at the edge of the domain.
  int neighbour(int rank, Dir d) const {
    int cx = rank % px;
    int cy = rank / px;
    if (d == Dir::kNorth) --cy;
    if (d == Dir::kSouth) ++cy;
    if (d == Dir::kEast) ++cx;
    if (d == Dir::kWest) --cx;
    if (cx < 0 || cx >= px || cy < 0 || cy >= py) return -1;
    return cy * px + cx;
  }
};

// Piece `index` of `n` cells split into `parts` near-equal pieces: {first cell, count}.
std::pair<int, int> split(int n, int parts, int index) {
  const int base = n / parts;
  const int extra = n % parts;
  const int first = index * base + std::min(index, extra);
  return {first, base + (index < extra ? 1 : 0)};
}

struct Block {
  int x0 = 0, y0 = 0;  // global coordinates of the first owned cell
  int nx = 0, ny = 0;  // owned cells along x and y

  static Block of_rank(const Config& c, const ProcessGrid& g, int rank) {
    Block b;
    std::tie(b.x0, b.nx) = split(c.nx, g.px, rank % g.px);
    std::tie(b.y0, b.ny) = split(c.ny, g.py, rank / g.px);
    return b;
  }
};

// ---------------------------------------------------------------------------------------------
// The problem: a block of cells with a one-cell ghost frame, fixed boundary values, Jacobi sweeps.

class Field {
 public:
  explicit Field(const Block& b)
      : nx_(b.nx), ny_(b.ny), v_(static_cast<std::size_t>(b.nx + 2) * (b.ny + 2)) {}
  int nx() const { return nx_; }
  int ny() const { return ny_; }
  // Cell (x, y) of the block, x in -1..nx and y in -1..ny (-1 and nx / ny are the ghost frame).
  double& at(int x, int y) { return v_[index(x, y)]; }
  double at(int x, int y) const { return v_[index(x, y)]; }
  // Row y holds nx contiguous owned cells starting at at(0, y): rows travel without a copy.
  double* row(int y) { return &at(0, y); }

 private:
  std::size_t index(int x, int y) const {
    return static_cast<std::size_t>(y + 1) * static_cast<std::size_t>(nx_ + 2) +
           static_cast<std::size_t>(x + 1);
  }
  int nx_, ny_;
  std::vector<double> v_;
};

// Fixed values just outside the grid: a hot top edge, a warm west edge, the rest cold.
double boundary_value(int gx, int gy) {
  if (gy < 0) return 1.0;
  if (gx < 0) return 0.5;
  return 0.0;
}

// A rough start (exact in binary) so the first iterations have sharp features to move.
double initial_value(int gx, int gy) { return ((gx * 7 + gy * 13) % 17) / 16.0; }

// Owned cells get the start value, frame cells on the domain's edge the boundary value, and frame
// cells a neighbour provides NaN: a halo that never arrives poisons the result visibly.
void init_field(Field& f, const Block& b, const Config& c) {
  for (int y = -1; y <= b.ny; ++y) {
    for (int x = -1; x <= b.nx; ++x) {
      const int gx = b.x0 + x;
      const int gy = b.y0 + y;
      const bool owned = x >= 0 && x < b.nx && y >= 0 && y < b.ny;
      const bool outside = gx < 0 || gx >= c.nx || gy < 0 || gy >= c.ny;
      if (owned) f.at(x, y) = initial_value(gx, gy);
      else if (outside) f.at(x, y) = boundary_value(gx, gy);
      else f.at(x, y) = std::numeric_limits<double>::quiet_NaN();
    }
  }
}

// One Jacobi step over the owned cells; returns max |new - old| over them.
double jacobi_sweep(const Field& cur, Field& next) {
  double residual = 0.0;
  for (int y = 0; y < cur.ny(); ++y) {
    for (int x = 0; x < cur.nx(); ++x) {
      const double v =
          0.25 * (cur.at(x, y - 1) + cur.at(x, y + 1) + cur.at(x - 1, y) + cur.at(x + 1, y));
      residual = std::max(residual, std::fabs(v - cur.at(x, y)));
      next.at(x, y) = v;
    }
  }
  return residual;
}

bool residual_due(const Config& c, int iteration) {
  return (iteration + 1) % c.residual_every == 0 || iteration + 1 == c.iters;
}

// The owned cells of a field, row by row.
std::vector<double> interior(const Field& f) {
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(f.nx()) * f.ny());
  for (int y = 0; y < f.ny(); ++y) {
    for (int x = 0; x < f.nx(); ++x) out.push_back(f.at(x, y));
  }
  return out;
}

struct Solution {
  std::vector<double> grid;  // ny x nx, row by row
  double residual = 0.0;     // after the last iteration
};

// The single-process solve rank 0 checks against: the whole grid as one block.
Solution reference_solve(const Config& c) {
  const Block whole{0, 0, c.nx, c.ny};
  Field cur(whole), next(whole);
  init_field(cur, whole, c);
  init_field(next, whole, c);
  Solution s;
  for (int it = 0; it < c.iters; ++it) {
    s.residual = jacobi_sweep(cur, next);
    std::swap(cur, next);
  }
  s.grid = interior(cur);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Messages

template <class T>
commux::Buffer as_buffer(T& value) {
  return commux::Buffer{&value, sizeof(value)};
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

// The requests of one step, and the rule that keeps their buffers safe: a buffer must stay alive
// until its request has finished, also when something throws (a timed-out wait leaves its operation
// posted, and dropping a Request cancels nothing). So wait_all() may throw, but the destructor
// first cancels whatever is unfinished and waits for it. Declare a Pending after the buffers its
// requests use: it is destroyed, and drained, before them.
class Pending {
 public:
  Pending() = default;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() { drain(); }

  commux::Request add(commux::Request r) {
    requests_.push_back(r);
    return r;
  }
  void wait_all() {
    for (commux::Request& r : requests_) r.wait();
  }

 private:
  void drain() noexcept {
    for (commux::Request& r : requests_) {
      if (r.done()) continue;
      r.cancel();
      try {
        r.wait();
      } catch (...) {  // kCanceled, the operation's own failure, or a timeout
      }
      if (!r.done()) {  // its buffer can never be released safely: stop here
        std::fprintf(stderr, "halo_demo: a cancelled request did not finish; exiting\n");
        std::_Exit(kExitFailed);
      }
    }
  }
  std::vector<commux::Request> requests_;
};

// User tags. A halo's tag is the direction it travels plus 10 on odd iterations (1..4, 11..14).
constexpr std::int64_t kTagResidualUp = 100;    // rank r -> 0: its local residual
constexpr std::int64_t kTagResidualDown = 101;  // 0 -> rank r: the global residual
constexpr std::int64_t kTagGather = 102;        // rank r -> 0: its block, at the end
constexpr std::int64_t kTagVerdict = 103;       // 0 -> rank r: did the check pass?
constexpr std::int64_t kTagDone = 104;          // rank r -> 0: verdict received, shutting down

std::int64_t halo_tag(Dir travel, int iteration) {
  return static_cast<std::int64_t>(travel) + 10 * (iteration % 2);
}

// Buffer 0 of every halo message; buffer 1 is the cells.
struct HaloHeader {
  std::int32_t iteration = -1;
  std::int32_t sender = -1;
  std::int32_t travel = 0;  // Dir the message travels
  std::int32_t cells = 0;
};

// ---------------------------------------------------------------------------------------------
// Halo exchange: fills the ghost frame of a field from up to four neighbours.

class HaloExchange {
 public:
  HaloExchange(commux::Communicator& comm, const ProcessGrid& grid, const Block& block,
               unsigned seed)
      : comm_(comm), rng_(seed) {
    for (Dir d : kAllDirs) {
      const int peer = grid.neighbour(comm.rank(), d);
      if (peer < 0) continue;
      Side s;
      s.dir = d;
      s.peer = peer;
      s.cells = (d == Dir::kNorth || d == Dir::kSouth) ? block.nx : block.ny;
      if (d == Dir::kEast || d == Dir::kWest) {
        s.send_packed.resize(static_cast<std::size_t>(s.cells));
        s.recv_packed.resize(static_cast<std::size_t>(s.cells));
      }
      sides_.push_back(std::move(s));
    }
  }

  void run(Field& f, int iteration) {
    for (Side& s : sides_) prepare_send(s, f, iteration);
    // One entry per operation: {side, is_send}, posted in a different random order every time.
    std::vector<std::pair<Side*, bool>> posts;
    for (Side& s : sides_) {
      posts.emplace_back(&s, false);
      posts.emplace_back(&s, true);
    }
    std::shuffle(posts.begin(), posts.end(), rng_);
    Pending pending;  // the buffers are the field's rows and the members of sides_
    for (auto& [side, is_send] : posts) pending.add(post(*side, f, iteration, is_send));
    pending.wait_all();
    for (Side& s : sides_) finish_recv(s, f, iteration);
  }

 private:
  struct Side {
    Dir dir = Dir::kNorth;  // where the neighbour is
    int peer = -1;
    int cells = 0;  // halo length
    HaloHeader send_header, recv_header;
    std::vector<double> send_packed, recv_packed;  // east / west columns only
  };

  static bool is_row(const Side& s) { return s.dir == Dir::kNorth || s.dir == Dir::kSouth; }
  // The owned row / column next to side s, and the ghost row / column beyond it.
  static int edge(const Side& s, const Field& f) {
    if (s.dir == Dir::kNorth || s.dir == Dir::kWest) return 0;
    return s.dir == Dir::kSouth ? f.ny() - 1 : f.nx() - 1;
  }
  static int ghost(const Side& s, const Field& f) {
    if (s.dir == Dir::kNorth || s.dir == Dir::kWest) return -1;
    return s.dir == Dir::kSouth ? f.ny() : f.nx();
  }

  void prepare_send(Side& s, Field& f, int iteration) {
    s.send_header = HaloHeader{iteration, comm_.rank(), static_cast<std::int32_t>(s.dir), s.cells};
    s.recv_header = HaloHeader{};
    if (is_row(s)) return;  // rows are sent straight from the field
    const int x = edge(s, f);
    for (int y = 0; y < s.cells; ++y) s.send_packed[static_cast<std::size_t>(y)] = f.at(x, y);
  }

  // {header, cells}: two buffers, one message, one Request.
  commux::Request post(Side& s, Field& f, int iteration, bool is_send) {
    const std::size_t bytes = static_cast<std::size_t>(s.cells) * sizeof(double);
    double* cells = nullptr;
    if (is_row(s)) cells = f.row(is_send ? edge(s, f) : ghost(s, f));
    else cells = is_send ? s.send_packed.data() : s.recv_packed.data();
    if (is_send) {
      const std::vector<commux::Buffer> msg{as_buffer(s.send_header), {cells, bytes}};
      return comm_.isend(msg, s.peer, halo_tag(s.dir, iteration));
    }
    const std::vector<commux::Buffer> msg{as_buffer(s.recv_header), {cells, bytes}};
    return comm_.irecv(msg, s.peer, halo_tag(opposite(s.dir), iteration));
  }

  void finish_recv(Side& s, Field& f, int iteration) {
    const HaloHeader& h = s.recv_header;
    const HaloHeader want{iteration, s.peer, static_cast<std::int32_t>(opposite(s.dir)), s.cells};
    if (h.iteration != want.iteration || h.sender != want.sender || h.travel != want.travel ||
        h.cells != want.cells) {
      fail(std::string("halo from the ") + dir_name(s.dir) + " (rank " + std::to_string(s.peer) +
           ") at iteration " + std::to_string(iteration) + " has header {iteration " +
           std::to_string(h.iteration) + ", sender " + std::to_string(h.sender) + ", travel " +
           std::to_string(h.travel) + ", cells " + std::to_string(h.cells) + "}, expected {" +
           std::to_string(want.iteration) + ", " + std::to_string(want.sender) + ", " +
           std::to_string(want.travel) + ", " + std::to_string(want.cells) + "}");
    }
    if (is_row(s)) return;  // already in the ghost row
    const int x = ghost(s, f);
    for (int y = 0; y < s.cells; ++y) f.at(x, y) = s.recv_packed[static_cast<std::size_t>(y)];
  }

  commux::Communicator& comm_;
  std::mt19937 rng_;
  std::vector<Side> sides_;
};

// ---------------------------------------------------------------------------------------------
// Residual: max over ranks, from point-to-point messages (gather at rank 0, send back).

struct ResidualMsg {
  double value = 0.0;
  std::int32_t rank = -1;
  std::int32_t iteration = -1;
};

// Rank 0: one kAnySource receive per other rank; each sender must show up exactly once, and the
// rank written in the payload must be the one Request::source() reports.
double collect_residuals(commux::Communicator& comm, double local, int iteration) {
  const int n = comm.size();
  std::vector<ResidualMsg> in(static_cast<std::size_t>(n));
  Pending pending;
  std::vector<commux::Request> recvs;
  for (int i = 1; i < n; ++i) {
    commux::Buffer slot = as_buffer(in[static_cast<std::size_t>(i)]);
    recvs.push_back(pending.add(comm.irecv(slot, commux::kAnySource, kTagResidualUp)));
  }
  std::vector<bool> seen(static_cast<std::size_t>(n), false);
  double global = local;
  for (int i = 1; i < n; ++i) {
    commux::Request& r = recvs[static_cast<std::size_t>(i - 1)];
    r.wait();
    const ResidualMsg& m = in[static_cast<std::size_t>(i)];
    const int src = r.source();
    if (src < 1 || src >= n || seen[static_cast<std::size_t>(src)] || m.rank != src ||
        m.iteration != iteration) {
      fail("residual at iteration " + std::to_string(iteration) + ": receive " + std::to_string(i) +
           " reports source " + std::to_string(src) + " and carries rank " +
           std::to_string(m.rank) + ", iteration " + std::to_string(m.iteration) +
           (src >= 1 && src < n && seen[static_cast<std::size_t>(src)] ? " (source seen twice)"
                                                                       : ""));
    }
    seen[static_cast<std::size_t>(src)] = true;
    global = std::max(global, m.value);
  }
  return global;
}

double global_residual(commux::Communicator& comm, double local, int iteration) {
  if (comm.rank() != 0) {
    ResidualMsg up{local, comm.rank(), iteration};
    ResidualMsg down;
    Pending pending;
    pending.add(comm.isend(as_buffer(up), 0, kTagResidualUp));
    pending.add(comm.irecv(as_buffer(down), 0, kTagResidualDown));
    pending.wait_all();
    if (down.iteration != iteration) {
      fail("global residual for iteration " + std::to_string(iteration) + " came back as " +
           "iteration " + std::to_string(down.iteration));
    }
    return down.value;
  }
  ResidualMsg down{collect_residuals(comm, local, iteration), 0, iteration};
  Pending pending;
  for (int r = 1; r < comm.size(); ++r) {
    pending.add(comm.isend(as_buffer(down), r, kTagResidualDown));
  }
  pending.wait_all();
  return down.value;
}

// ---------------------------------------------------------------------------------------------
// End of the run: gather the grid at rank 0, check it, tell every rank the verdict.

struct BlockHeader {
  std::int32_t x0 = -1, y0 = -1, nx = -1, ny = -1;
};

void send_block(commux::Communicator& comm, const Field& f, const Block& b) {
  BlockHeader h{b.x0, b.y0, b.nx, b.ny};
  std::vector<double> cells = interior(f);
  Pending pending;
  const std::size_t bytes = cells.size() * sizeof(double);
  const std::vector<commux::Buffer> msg{as_buffer(h), {cells.data(), bytes}};
  pending.add(comm.isend(msg, 0, kTagGather));
  pending.wait_all();
}

void place(std::vector<double>& grid, const Config& c, const Block& b,
           const std::vector<double>& cells) {
  for (int y = 0; y < b.ny; ++y) {
    std::copy_n(cells.begin() + static_cast<std::ptrdiff_t>(y) * b.nx, b.nx,
                grid.begin() + static_cast<std::ptrdiff_t>(b.y0 + y) * c.nx + b.x0);
  }
}

std::vector<double> gather_grid(commux::Communicator& comm, const Field& f, const Config& c,
                                const ProcessGrid& g) {
  const int n = comm.size();
  std::vector<double> grid(static_cast<std::size_t>(c.nx) * c.ny);
  place(grid, c, Block::of_rank(c, g, 0), interior(f));
  std::vector<BlockHeader> headers(static_cast<std::size_t>(n));
  std::vector<std::vector<double>> cells(static_cast<std::size_t>(n));
  Pending pending;
  for (int r = 1; r < n; ++r) {
    const Block b = Block::of_rank(c, g, r);
    auto& buf = cells[static_cast<std::size_t>(r)];
    buf.resize(static_cast<std::size_t>(b.nx) * b.ny);
    pending.add(comm.irecv({as_buffer(headers[static_cast<std::size_t>(r)]),
                            {buf.data(), buf.size() * sizeof(double)}},
                           r, kTagGather));
  }
  pending.wait_all();
  for (int r = 1; r < n; ++r) {
    const Block b = Block::of_rank(c, g, r);
    const BlockHeader& h = headers[static_cast<std::size_t>(r)];
    if (h.x0 != b.x0 || h.y0 != b.y0 || h.nx != b.nx || h.ny != b.ny) {
      fail("rank " + std::to_string(r) + " sent the block at (" + std::to_string(h.x0) + ", " +
           std::to_string(h.y0) + ") of " + std::to_string(h.nx) + "x" + std::to_string(h.ny) +
           ", expected (" + std::to_string(b.x0) + ", " + std::to_string(b.y0) + ") of " +
           std::to_string(b.nx) + "x" + std::to_string(b.ny));
    }
    place(grid, c, b, cells[static_cast<std::size_t>(r)]);
  }
  return grid;
}

// max |a - b| over the grid; NaN (a halo that never arrived) counts as infinitely far.
double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    worst = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(worst, d);
  }
  return worst;
}

struct RunStats {
  double residual = 0.0;
  double seconds = 0.0;  // the iteration loop on rank 0
};

// Rank 0: compare with the single-process solve and print the results. True when they agree.
bool check_at_rank0(const std::vector<double>& grid, const RunStats& run, const Config& c) {
  const Solution ref = reference_solve(c);
  const double diff = max_difference(grid, ref.grid);
  const bool bitwise = std::memcmp(grid.data(), ref.grid.data(), grid.size() * sizeof(double)) == 0;
  const bool grid_ok = diff <= 1e-12;
  const bool residual_ok = std::fabs(run.residual - ref.residual) <= 1e-12;
  std::printf("halo_demo: max |distributed - reference| = %.3g%s\n", diff,
              bitwise ? " (bitwise identical)" : "");
  std::printf("halo_demo: residual after %d iterations = %.6e (reference %.6e)\n", c.iters,
              run.residual, ref.residual);
  std::printf("halo_demo: %.3f ms per iteration on rank 0 (%d iterations in %.3f s)\n",
              1e3 * run.seconds / c.iters, c.iters, run.seconds);
  if (!grid_ok) std::printf("halo_demo: rank 0: the grid differs from the reference\n");
  if (!residual_ok) std::printf("halo_demo: rank 0: the residual differs from the reference\n");
  std::fflush(stdout);
  return grid_ok && residual_ok;
}

// A closing handshake: every rank learns rank 0's verdict (so every exit code reflects it) and
// acknowledges it; rank 0 posts the acknowledgement receives before it sends anything and shuts
// down only when all have arrived. So all ranks finish together, and no rank posts a receive from a
// peer that has already gone -- the demo does not depend on how commux treats such a receive.
bool share_verdict(commux::Communicator& comm, bool ok) {
  std::int32_t verdict = ok ? 1 : 0;
  if (comm.rank() != 0) {
    {
      Pending pending;
      pending.add(comm.irecv(as_buffer(verdict), 0, kTagVerdict));
      pending.wait_all();
    }
    Pending pending;
    pending.add(comm.isend(as_buffer(verdict), 0, kTagDone));
    pending.wait_all();
    return verdict == 1;
  }
  std::vector<std::int32_t> acks(static_cast<std::size_t>(comm.size()));
  Pending pending;
  for (int r = 1; r < comm.size(); ++r) {
    pending.add(comm.irecv(as_buffer(acks[static_cast<std::size_t>(r)]), r, kTagDone));
  }
  for (int r = 1; r < comm.size(); ++r) {
    pending.add(comm.isend(as_buffer(verdict), r, kTagVerdict));
  }
  pending.wait_all();
  return ok;
}

// ---------------------------------------------------------------------------------------------
// One rank

// commux waits give up a little before the parent's deadline, so a stuck receive is reported by
// commux (naming peer and tag) rather than by a kill.
commux::Options rank_options(const Config& c) {
  commux::Options o = commux::Options::from_env();
  o.timeout = std::min(o.timeout, std::chrono::milliseconds(750L * c.timeout_s));
  return o;
}

int run_rank(const Config& c, int rank, const std::string& store_dir) {
  auto store = std::make_shared<commux::FileStore>(store_dir);
  commux::Communicator comm(store, rank, c.ranks, rank_options(c));
  const ProcessGrid grid = ProcessGrid::for_ranks(c.ranks);
  const Block block = Block::of_rank(c, grid, rank);
  Field cur(block), next(block);
  init_field(cur, block, c);
  init_field(next, block, c);
  HaloExchange halos(comm, grid, block, c.seed + static_cast<unsigned>(rank));

  RunStats run;
  const auto start = Clock::now();
  for (int it = 0; it < c.iters; ++it) {
    halos.run(cur, it);
    const double local = jacobi_sweep(cur, next);
    std::swap(cur, next);
    if (residual_due(c, it)) run.residual = global_residual(comm, local, it);
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();

  bool ok = true;
  if (rank == 0) ok = check_at_rank0(gather_grid(comm, cur, c, grid), run, c);
  else send_block(comm, cur, block);
  return share_verdict(comm, ok) ? kExitOk : kExitMismatch;
}

// ---------------------------------------------------------------------------------------------
// The parent: start N ranks, wait for them with a deadline, report.

void on_watchdog(int) {
  static const char msg[] = "halo_demo: a rank's watchdog fired (alarm); exiting\n";
  [[maybe_unused]] const ssize_t w = ::write(2, msg, sizeof(msg) - 1);
  _exit(kExitWatchdog);
}

[[noreturn]] void child_main(const Config& c, int rank, const std::string& store_dir) {
  ::signal(SIGALRM, on_watchdog);
  ::alarm(static_cast<unsigned>(c.timeout_s) + 5);  // outlives the parent's deadline: a backstop
  int code = kExitFailed;
  try {
    code = run_rank(c, rank, store_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "halo_demo: rank %d: error: %s\n", rank, e.what());
  }
  std::fflush(nullptr);
  _exit(code);
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = true;
  std::string outcome;  // empty when it succeeded
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) {
    if (WEXITSTATUS(status) == kExitWatchdog) return "hung (its watchdog fired)";
    if (WEXITSTATUS(status) == kExitMismatch) return "exited: the grid differs from the reference";
    return "exited with status " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "ended with status " + std::to_string(status);
}

void stop_running(std::vector<Child>& children, const std::string& why) {
  for (Child& ch : children) {
    if (!ch.running || !ch.outcome.empty()) continue;
    ::kill(ch.pid, SIGKILL);
    ch.outcome = why;
  }
}

// Reaps children until all are gone. After the first failure the others get a short grace period
// to finish or to fail on their own (commux reports a dead peer within seconds), so that each
// rank's own reason is reported; then they are killed. At the deadline all that runs is killed.
void wait_for(std::vector<Child>& children, const Config& c) {
  constexpr auto kGrace = std::chrono::seconds(2);
  auto kill_at = Clock::now() + std::chrono::seconds(c.timeout_s);
  std::string kill_reason =
      "still running after the " + std::to_string(c.timeout_s) + " s timeout (killed)";
  bool failure_seen = false;
  bool killed = false;
  auto running =
      std::count_if(children.begin(), children.end(), [](const Child& ch) { return ch.running; });
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    auto ch = std::find_if(children.begin(), children.end(),
                           [&](const Child& x) { return pid > 0 && x.pid == pid; });
    if (ch != children.end()) {
      ch->running = false;
      --running;
      if (WIFEXITED(status) && WEXITSTATUS(status) == kExitOk) {
        ch->outcome.clear();             // it finished before a kill could reach it
      } else if (ch->outcome.empty()) {  // not killed by us
        ch->outcome = describe_status(status);
        if (!failure_seen && Clock::now() + kGrace < kill_at) {
          kill_at = Clock::now() + kGrace;
          kill_reason =
              "killed: still running 2 s after rank " + std::to_string(ch->rank) + " failed";
        }
        failure_seen = true;
      }
      continue;
    }
    if (!killed && Clock::now() >= kill_at) {
      killed = true;
      stop_running(children, kill_reason);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string make_store_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/commux-halo-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::perror("halo_demo: mkdtemp");
    std::exit(kExitFailed);
  }
  return tmpl;
}

}  // namespace

int main(int argc, char** argv) {
  const Config c = parse_args(argc, argv);
  const ProcessGrid grid = ProcessGrid::for_ranks(c.ranks);
  if (c.nx < grid.px || c.ny < grid.py) {
    usage("a " + std::to_string(c.nx) + "x" + std::to_string(c.ny) + " grid cannot be split " +
          "over " + std::to_string(grid.px) + "x" + std::to_string(grid.py) + " ranks");
  }
  ::setenv("UCX_NET_DEVICES", "lo", 0);  // local ranks: loopback, unless the user chose otherwise
  const std::string store_dir = make_store_dir();
  std::printf("halo_demo: %dx%d grid, %d iterations, %d ranks as %dx%d blocks, seed %u\n", c.nx,
              c.ny, c.iters, c.ranks, grid.px, grid.py, c.seed);
  std::fflush(nullptr);  // children must not inherit unflushed output

  std::vector<Child> children;
  for (int r = 0; r < c.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) child_main(c, r, store_dir);
    if (pid < 0) {
      std::perror("halo_demo: fork");
      Child failed{r, -1, false, "could not be started"};
      children.push_back(failed);
      stop_running(children, "stopped because rank " + std::to_string(r) + " could not start");
      break;
    }
    children.push_back(Child{r, pid, true, ""});
  }
  wait_for(children, c);
  std::error_code ignored;
  std::filesystem::remove_all(store_dir, ignored);

  std::string failures;
  for (const Child& ch : children) {
    if (ch.outcome.empty()) continue;
    if (!failures.empty()) failures += "; ";
    failures += "rank " + std::to_string(ch.rank) + " " + ch.outcome;
  }
  if (static_cast<int>(children.size()) < c.ranks) failures += "; later ranks were never started";
  if (failures.empty()) {
    std::printf("halo_demo: OK\n");
    return kExitOk;
  }
  std::printf("halo_demo: FAILED: %s\n", failures.c_str());
  return kExitFailed;
}
