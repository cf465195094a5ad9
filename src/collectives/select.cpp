// The algorithm tables of every collective, forcing (Context::algorithm, then force_algorithm(),
// then the COMMUX_ALGO_<OP> variable, from commux::settings(): read once per process) and
// last_algorithm().
#include <array>
#include <atomic>
#include <cctype>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "algo.hpp"
#include "commux/settings.hpp"

namespace commux::coll {

namespace detail {

namespace {

constexpr std::size_t kColls = static_cast<std::size_t>(Coll::kCount);
constexpr std::array<const char*, kColls> kNames = {"allreduce", "broadcast",      "reduce",
                                                    "allgather", "reduce_scatter", "alltoall",
                                                    "barrier",   "gather",         "scatter"};

template <class A, std::size_t N>
Table<A> make_table(Coll c, const Algorithm<A>* const (&list)[N]) {
  return Table<A>{c, list, N};
}

std::vector<std::string> names_of(Coll c) {
  std::vector<std::string> v;
  auto add = [&](const auto& tab) {
    for (std::size_t i = 0; i < tab.size; ++i) v.emplace_back(tab.list[i]->name);
  };
  switch (c) {
    case Coll::kAllreduce: add(allreduce_table()); break;
    case Coll::kBroadcast: add(broadcast_table()); break;
    case Coll::kReduce: add(reduce_table()); break;
    case Coll::kAllgather: add(allgather_table()); break;
    case Coll::kReduceScatter: add(reduce_scatter_table()); break;
    case Coll::kAlltoall: add(alltoall_table()); break;
    case Coll::kBarrier: add(barrier_table()); break;
    case Coll::kGather: add(gather_table()); break;
    case Coll::kScatter: add(scatter_table()); break;
    case Coll::kCount: break;
  }
  return v;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

bool is_auto(const char* name) {
  return name == nullptr || *name == '\0' || std::strcmp(name, "auto") == 0;
}

Coll coll_of(const char* op) {
  std::string s = op != nullptr ? op : "";
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (s == "allgatherv") s = "allgather";
  if (s == "alltoallv") s = "alltoall";
  for (std::size_t i = 0; i < kColls; ++i) {
    if (s == kNames[i]) return static_cast<Coll>(i);
  }
  std::vector<std::string> all(kNames.begin(), kNames.end());
  throw Error(Errc::kInvalidArgument, "commux algorithms: unknown collective '" +
                                          std::string(op != nullptr ? op : "(null)") +
                                          "'; the collectives are: " + join(all));
}

// The variables, in kNames' order, and their values as read once per process (commux::settings()).
constexpr std::array<const char*, kColls> kEnv = {
    "COMMUX_ALGO_ALLREDUCE", "COMMUX_ALGO_BROADCAST",      "COMMUX_ALGO_REDUCE",
    "COMMUX_ALGO_ALLGATHER", "COMMUX_ALGO_REDUCE_SCATTER", "COMMUX_ALGO_ALLTOALL",
    "COMMUX_ALGO_BARRIER",   "COMMUX_ALGO_GATHER",         "COMMUX_ALGO_SCATTER"};

const std::string& env_algorithm(std::size_t i) {
  static const std::array<std::string, kColls> values = [] {
    std::array<std::string, kColls> v;
    for (std::size_t k = 0; k < kColls; ++k) v[k] = commux::settings().text(kEnv[k]);
    return v;
  }();
  return values[i];
}

// The process-wide choices of force_algorithm(); `any` lets calls skip the lock when none is set.
struct Forced {
  std::mutex mu;
  std::array<std::string, kColls> name;  // "" = none
  std::atomic<int> any{0};
};

Forced& forced() {
  static Forced* f = new Forced;  // intentionally leaked: usable at exit
  return *f;
}

thread_local const char* t_last = "";

}  // namespace

const char* coll_name(Coll c) { return kNames[static_cast<std::size_t>(c)]; }

std::string forced_name(const Context& ctx, Coll c, const char** source) {
  if (!is_auto(ctx.algorithm)) {
    *source = "Context::algorithm";
    return ctx.algorithm;
  }
  const auto i = static_cast<std::size_t>(c);
  Forced& f = forced();
  if (f.any.load(std::memory_order_acquire) != 0) {
    std::lock_guard<std::mutex> g(f.mu);
    if (!f.name[i].empty()) {
      *source = "force_algorithm";
      return f.name[i];
    }
  }
  const std::string& env = env_algorithm(i);
  if (is_auto(env.c_str())) return {};
  *source = kEnv[i];
  return env;
}

void set_last_algorithm(const char* name) noexcept { t_last = name; }

namespace {

// "64 KiB" for a power of two.
std::string pow2_text(std::size_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return std::to_string(b) + " " + units[u];
}

}  // namespace

void log_choice(const Context& ctx, Coll c, int n, std::size_t bytes, const char* name,
                const std::string& why) {
  int cls = 0;  // 0: no bytes; k: [2^(k-1), 2^k)
  while (cls < 64 && (bytes >> cls) != 0) ++cls;
  static auto* mu = new std::mutex;  // both never destroyed: usable at exit
  static auto* seen = new std::set<std::tuple<int, int, int, std::string>>;
  {
    std::lock_guard<std::mutex> g(*mu);
    if (!seen->emplace(static_cast<int>(c), n, cls, name).second) return;
  }
  const std::string size =
      cls == 0 ? std::string("0 bytes")
               : "[" + pow2_text(std::size_t{1} << (cls - 1)) + ", " +
                     (cls < 64 ? pow2_text(std::size_t{1} << cls) : std::string("inf")) + ")";
  COMMUX_LOG(kInfo, ctx.comm != nullptr ? ctx.comm->rank() : -1, coll_name(c), " on ", n,
             " ranks, ", size, ": ", name, " (chosen by ", why, ")");
}

void unknown_algorithm(const Context& ctx, Coll c, const char* name, const char* source) {
  Exchange::invalid(ctx, std::string("unknown ") + coll_name(c) + " algorithm '" + name +
                             "' (from " + source + "); the " + coll_name(c) +
                             " algorithms are: " + join(names_of(c)) + " (or auto)");
}

// ---- the tables ---------------------------------------------------------------------------------

const Table<AllreduceArgs>& allreduce_table() {
  static const Algorithm<AllreduceArgs>* const list[] = {&algo::allreduce_recursive_doubling,
                                                         &algo::allreduce_halves,
                                                         &algo::allreduce_ring,
                                                         &algo::allreduce_rabenseifner};
  static const Table<AllreduceArgs> t = make_table(Coll::kAllreduce, list);
  return t;
}
const Table<BroadcastArgs>& broadcast_table() {
  static const Algorithm<BroadcastArgs>* const list[] = {&algo::broadcast_binomial,
                                                         &algo::broadcast_scatter_allgather};
  static const Table<BroadcastArgs> t = make_table(Coll::kBroadcast, list);
  return t;
}
const Table<ReduceArgs>& reduce_table() {
  static const Algorithm<ReduceArgs>* const list[] = {&algo::reduce_binomial,
                                                      &algo::reduce_rabenseifner};
  static const Table<ReduceArgs> t = make_table(Coll::kReduce, list);
  return t;
}
const Table<AllgatherArgs>& allgather_table() {
  static const Algorithm<AllgatherArgs>* const list[] = {&algo::allgather_ring,
                                                         &algo::allgather_recursive_doubling,
                                                         &algo::allgather_bruck};
  static const Table<AllgatherArgs> t = make_table(Coll::kAllgather, list);
  return t;
}
const Table<ReduceScatterArgs>& reduce_scatter_table() {
  static const Algorithm<ReduceScatterArgs>* const list[] = {
      &algo::reduce_scatter_ring, &algo::reduce_scatter_recursive_halving};
  static const Table<ReduceScatterArgs> t = make_table(Coll::kReduceScatter, list);
  return t;
}
const Table<AlltoallArgs>& alltoall_table() {
  static const Algorithm<AlltoallArgs>* const list[] = {&algo::alltoall_pairwise,
                                                        &algo::alltoall_linear};
  static const Table<AlltoallArgs> t = make_table(Coll::kAlltoall, list);
  return t;
}
const Table<BarrierArgs>& barrier_table() {
  static const Algorithm<BarrierArgs>* const list[] = {&algo::barrier_dissemination};
  static const Table<BarrierArgs> t = make_table(Coll::kBarrier, list);
  return t;
}
const Table<RootedArgs>& gather_table() {
  static const Algorithm<RootedArgs>* const list[] = {&algo::gather_binomial, &algo::gather_linear};
  static const Table<RootedArgs> t = make_table(Coll::kGather, list);
  return t;
}
const Table<RootedArgs>& scatter_table() {
  static const Algorithm<RootedArgs>* const list[] = {&algo::scatter_binomial,
                                                      &algo::scatter_linear};
  static const Table<RootedArgs> t = make_table(Coll::kScatter, list);
  return t;
}

}  // namespace detail

std::vector<std::string> algorithms(const char* op) {
  return detail::names_of(detail::coll_of(op));
}

void force_algorithm(const char* op, const char* name) {
  const detail::Coll c = detail::coll_of(op);
  const auto i = static_cast<std::size_t>(c);
  std::string value;
  if (!detail::is_auto(name)) {
    const auto names = detail::names_of(c);
    bool known = false;
    for (const auto& x : names) known = known || x == name;
    if (!known) {
      throw Error(Errc::kInvalidArgument,
                  std::string("commux force_algorithm: unknown ") + detail::coll_name(c) +
                      " algorithm '" + name + "'; the " + detail::coll_name(c) +
                      " algorithms are: " + detail::join(names) + " (or auto)");
    }
    value = name;
  }
  detail::Forced& f = detail::forced();
  std::lock_guard<std::mutex> g(f.mu);
  f.name[i] = value;
  int any = 0;
  for (const auto& x : f.name) any += x.empty() ? 0 : 1;
  f.any.store(any, std::memory_order_release);
}

std::string forced_algorithm(const char* op) {
  const auto i = static_cast<std::size_t>(detail::coll_of(op));
  detail::Forced& f = detail::forced();
  {
    std::lock_guard<std::mutex> g(f.mu);
    if (!f.name[i].empty()) return f.name[i];
  }
  const std::string& env = detail::env_algorithm(i);
  return detail::is_auto(env.c_str()) ? std::string() : env;
}

const char* last_algorithm() noexcept { return detail::t_last; }

}  // namespace commux::coll
