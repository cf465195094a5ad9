#include "flight_recorder.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "commux/error.hpp"
#include "commux/settings.hpp"
#include "errors.hpp"

namespace commux::c10d_detail {

namespace {

const std::string kAskKey = "commux/trace/ask";
std::string answer_key(int rank) { return "commux/trace/answer/" + std::to_string(rank); }

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* state_name(FlightRecorder::State s) {
  switch (s) {
    case FlightRecorder::State::kIssued: return "issued";
    case FlightRecorder::State::kRunning: return "running";
    case FlightRecorder::State::kCompleted: return "completed";
    case FlightRecorder::State::kFailed: return "failed";
    case FlightRecorder::State::kTimedOut: return "timed_out";
  }
  return "?";
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// --- the process's recorders, for dumps -----------------------------------------------------------

std::mutex& registry_mu() {
  static auto* mu = new std::mutex;  // never destroyed: a dump may run while the process exits
  return *mu;
}
std::vector<const FlightRecorder*>& registry() {
  static auto* r = new std::vector<const FlightRecorder*>;
  return *r;
}
int& registry_rank() {  // the rank of the first group created (the default group's)
  static int rank = -1;
  return rank;
}

// The answering thread: one per process (not one per group: groups hold no thread while idle,
// src/c10d/pool.hpp), polling every recorder's store every kPollPeriod while any recorder exists,
// ending when the last one goes. poll_mu is held while it polls, so a recorder is destroyed only
// between two rounds (lock order: poll_mu, then registry_mu).
struct Poller {
  std::mutex poll_mu;
  std::mutex mu;  // guards running and wakes the thread
  std::condition_variable cv;
  bool running = false;
};
Poller& poller() {
  static auto* p = new Poller;  // never destroyed: the detached thread may outlive statics
  return *p;
}

// SIGUSR1: the handler writes a byte to a pipe; a thread (started with the handler, only when
// COMMUX_TRACE_DUMP is set) writes the dump outside signal context.
int g_pipe[2] = {-1, -1};
struct sigaction g_previous{};

void on_sigusr1(int sig, siginfo_t* info, void* ctx) {
  const int saved = errno;
  const char b = 1;
  [[maybe_unused]] const ssize_t n = ::write(g_pipe[1], &b, 1);
  errno = saved;
  // Chain to the handler this one replaced (Python's faulthandler, for one); the default action
  // (terminate) is what COMMUX_TRACE_DUMP replaces.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
  }
}

void install_signal_dump_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (::pipe2(g_pipe, O_CLOEXEC) != 0) return;
    std::thread([] {
      char b = 0;
      for (;;) {
        const ssize_t n = ::read(g_pipe[0], &b, 1);
        if (n == 1) {
          FlightRecorder::dump_all("SIGUSR1");
        } else if (n < 0 && errno != EINTR) {
          return;
        }
      }
    }).detach();
    struct sigaction sa{};
    sa.sa_sigaction = on_sigusr1;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGUSR1, &sa, &g_previous);
  });
}

std::string dump_path(int rank) {
  const std::string& d = settings().trace_dump;
  struct stat st{};
  if (d.back() == '/' || (::stat(d.c_str(), &st) == 0 && S_ISDIR(st.st_mode))) {
    return d + (d.back() == '/' ? "" : "/") + "commux_trace_" + std::to_string(rank) + ".json";
  }
  return d + std::to_string(rank) + ".json";
}

// --- answers ---------------------------------------------------------------------------------------

// An answer, as read back (see answer_locked() for the format).
struct Answer {
  bool got = false;
  std::int64_t gen = 0;
  bool has_issued = false;
  std::uint64_t issued_seq = 0;
  std::string issued_op, issued_state;
  bool has_completed = false;
  std::uint64_t completed_seq = 0;
  std::string completed_op;
  struct Item {
    std::uint64_t seq;
    std::string op, state;
    std::uint64_t bytes;
    int root;
  };
  std::vector<Item> entries;  // oldest first
};

Answer parse_answer(const std::vector<std::uint8_t>& raw) {
  Answer a;
  std::istringstream in(std::string(raw.begin(), raw.end()));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream l(line);
    std::string word;
    l >> word;
    if (word == "gen") {
      l >> a.gen;
      a.got = true;
    } else if (word == "issued") {
      a.has_issued = static_cast<bool>(l >> a.issued_seq >> a.issued_op >> a.issued_state);
    } else if (word == "completed") {
      a.has_completed = static_cast<bool>(l >> a.completed_seq >> a.completed_op);
    } else if (word == "entry") {
      Answer::Item it{};
      it.root = -1;
      if (l >> it.seq >> it.op >> it.state >> it.bytes >> it.root) a.entries.push_back(it);
    }
  }
  return a;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    // Appended piece by piece: GCC 12's -Wrestrict misfires on `"," + std::to_string(..)` at -O3.
    if (i > 0) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s;
}

std::string what_it_last_did(const Answer& a) {
  if (!a.has_issued) return "it has issued nothing in this group";
  std::string s = "it last issued " + a.issued_op + " #" + std::to_string(a.issued_seq);
  if (a.has_completed && a.completed_seq == a.issued_seq) {
    return "it last issued and completed " + a.issued_op + " #" + std::to_string(a.issued_seq);
  }
  s += " (" + a.issued_state + ")";
  if (a.has_completed) {
    s += " and last completed " + a.completed_op + " #" + std::to_string(a.completed_seq);
  } else {
    s += " and has completed none";
  }
  return s;
}

}  // namespace

// --- FlightRecorder --------------------------------------------------------------------------------

FlightRecorder::FlightRecorder(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                               std::string group)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      group_(std::move(group)),
      wall_offset_us_(now_us() - std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count()) {
  {
    std::lock_guard<std::mutex> lk(registry_mu());
    registry().push_back(this);
    if (registry_rank() < 0) registry_rank() = rank;
  }
  if (!settings().trace_dump.empty()) install_signal_dump_once();
  start_poller();
}

void FlightRecorder::start_poller() {
  Poller& p = poller();
  std::lock_guard<std::mutex> lk(p.mu);
  if (p.running) return;
  p.running = true;
  std::thread([] {
    Poller& q = poller();
    for (;;) {
      {
        std::unique_lock<std::mutex> sleep(q.mu);
        q.cv.wait_for(sleep, kPollPeriod);
      }
      std::lock_guard<std::mutex> round(q.poll_mu);
      std::vector<const FlightRecorder*> all;
      {
        std::lock_guard<std::mutex> reg(registry_mu());
        all = registry();
        if (all.empty()) {
          std::lock_guard<std::mutex> state(q.mu);
          q.running = false;
          return;
        }
      }
      for (const FlightRecorder* r : all) const_cast<FlightRecorder*>(r)->poll();
    }
  }).detach();
}

FlightRecorder::~FlightRecorder() {
  std::lock_guard<std::mutex> round(poller().poll_mu);  // not while the poller polls this one
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& r = registry();
  for (auto it = r.begin(); it != r.end(); ++it) {
    if (*it == this) {
      r.erase(it);
      break;
    }
  }
}

std::int64_t FlightRecorder::wall_us(std::chrono::steady_clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count() +
         wall_offset_us_;
}

void FlightRecorder::issued(std::uint64_t seq, const char* op, std::size_t bytes, int root,
                            std::chrono::steady_clock::time_point at, bool running) {
  const std::int64_t t = wall_us(at);
  std::lock_guard<std::mutex> lk(mu_);
  const State state = running ? State::kRunning : State::kIssued;
  ring_[count_ % kCapacity] = Entry{seq, op, bytes, state, t, running ? t : 0, 0, root};
  ++count_;
}

FlightRecorder::Entry* FlightRecorder::find_locked(std::uint64_t seq) {
  const std::uint64_t n = std::min<std::uint64_t>(count_, kCapacity);
  for (std::uint64_t i = 1; i <= n; ++i) {  // newest first: the one asked for is near the end
    Entry& e = ring_[(count_ - i) % kCapacity];
    if (e.seq == seq) return &e;
  }
  return nullptr;
}

void FlightRecorder::started(std::uint64_t seq) {
  const std::int64_t t = now_wall_us();
  std::lock_guard<std::mutex> lk(mu_);
  if (Entry* e = find_locked(seq)) {
    e->state = State::kRunning;
    e->started_us = t;
  }
}

std::int64_t FlightRecorder::coarse_wall_us() const {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // steady_clock's clock, a tick behind at most
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000 + wall_offset_us_;
}

std::exception_ptr FlightRecorder::finished(std::uint64_t seq, std::exception_ptr error) {
  const std::int64_t t = error ? now_wall_us() : coarse_wall_us();
  bool timed_out = false;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      timed_out = e.code() == Errc::kTimeout;
    } catch (...) {
    }
  }
  const char* op = "";
  std::int64_t ran_us = -1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    Entry* e = find_locked(seq);
    if (e != nullptr) {
      e->finished_us = std::max({t, e->issued_us, e->started_us});  // (the coarse clock lags)
      if (e->started_us > 0) ran_us = e->finished_us - e->started_us;
      e->state = !error ? State::kCompleted : timed_out ? State::kTimedOut : State::kFailed;
      op = e->op;
      if (!error) {
        last_completed_ = *e;
        any_completed_ = true;
      }
    }
  }
  if (!timed_out) return error;
  const std::string text = report(seq, op);
  dump_all("timeout in " + std::string(op) + " #" + std::to_string(seq) + " of group '" + group_ +
           "'");
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    // The core names the length of the last wait it made, which a collective waits in slices
    // (to look for other calls between them): say how long the collective ran instead.
    const std::string reason =
        ran_us >= 0 ? with_wait_length(e.reason(), ran_us / 1000, /*anywhere=*/true) : e.reason();
    return std::make_exception_ptr(
        Error(e.code(), e.site(), reason + ". " + text, e.still_posted()));
  } catch (...) {
  }
  return error;  // not reached: only a commux::Error is a timeout here
}

std::string FlightRecorder::answer_locked(std::int64_t gen) const {
  // Line-based, for the asker's parser; the ring's JSON follows for the dump.
  std::ostringstream s;
  s << "gen " << gen << "\n";
  if (count_ > 0) {
    const Entry& e = ring_[(count_ - 1) % kCapacity];
    s << "issued " << e.seq << " " << e.op << " " << state_name(e.state) << "\n";
  }
  if (any_completed_) s << "completed " << last_completed_.seq << " " << last_completed_.op << "\n";
  const std::uint64_t n = std::min<std::uint64_t>(count_, kCapacity);
  for (std::uint64_t i = count_ - n; i < count_; ++i) {
    const Entry& e = ring_[i % kCapacity];
    s << "entry " << e.seq << " " << e.op << " " << state_name(e.state) << " " << e.bytes << " "
      << e.root << "\n";
  }
  return s.str();
}

void FlightRecorder::answer(std::int64_t gen) {
  std::string text;
  {
    std::lock_guard<std::mutex> lk(mu_);
    text = answer_locked(gen);
  }
  store_->set(answer_key(rank_), std::vector<std::uint8_t>(text.begin(), text.end()));
  answered_ = gen;
}

void FlightRecorder::poll() {
  try {
    // check + get, not add(key, 0): a FileStore appends a record for every add.
    if (!store_->check({kAskKey})) return;
    const std::vector<std::uint8_t> raw = store_->get(kAskKey);  // the counter, in decimal
    const std::int64_t gen = std::stoll(std::string(raw.begin(), raw.end()));
    if (gen <= answered_) return;
    answer(gen);
    dump_all("asked by a rank whose collective timed out in group '" + group_ + "'");
  } catch (...) {
    // The store is gone (shutdown, a dead rank 0): nobody can ask; the next poll tries again.
  }
}

std::string FlightRecorder::report(std::uint64_t seq, const char* op) {
  const std::string head = "Hang report (group '" + group_ + "', " + op + " #" +
                           std::to_string(seq) + ", from rank " + std::to_string(rank_) + "): ";
  std::map<int, Answer> got;
  try {
    const std::int64_t gen = store_->add(kAskKey, 1);
    answer(gen);
    {
      std::lock_guard<std::mutex> lk(mu_);
      const std::string mine = answer_locked(gen);
      got[rank_] = parse_answer(std::vector<std::uint8_t>(mine.begin(), mine.end()));
    }
    const auto until = std::chrono::steady_clock::now() + kAnswerWait;
    for (;;) {
      for (int r = 0; r < size_; ++r) {
        if (got.count(r) != 0U || !store_->check({answer_key(r)})) continue;
        Answer a = parse_answer(store_->get(answer_key(r)));
        // An older answer still tells where that rank is if it has finished this very call (a
        // rank that timed out in it answered its own question, and is busy with its report).
        const bool settled = std::any_of(a.entries.begin(), a.entries.end(), [&](const auto& e) {
          return e.seq == seq && e.state != "issued" && e.state != "running";
        });
        if (a.got && (a.gen >= gen || settled)) got[r] = std::move(a);
      }
      if (static_cast<int>(got.size()) == size_ || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (...) {
    if (got.size() <= 1) {
      return head + "the group's store could not be asked (" + current_message().substr(0, 300) +
             ")";
    }
  }
  std::vector<int> waiting, silent;
  std::vector<const Answer::Item*> waiting_in;  // their entries for this call
  std::vector<std::string> parts;               // about the ranks that are not where this one is
  for (int r = 0; r < size_; ++r) {
    auto it = got.find(r);
    if (it == got.end()) {
      silent.push_back(r);
      continue;
    }
    const Answer& a = it->second;
    const Answer::Item* here = nullptr;
    for (const auto& item : a.entries) {
      if (item.seq == seq) here = &item;
    }
    const std::string rs = "rank " + std::to_string(r);
    if (here != nullptr && here->op != op) {
      parts.push_back(rs + " is in " + here->op + " #" + std::to_string(seq) + " (" + here->state +
                      "), not " + op);
    } else if (here != nullptr && here->state == "completed") {
      parts.push_back(rs + " completed it");
    } else if (here != nullptr && here->state == "failed") {
      parts.push_back(rs + " failed in it");
    } else if (here != nullptr && here->state == "timed_out" && a.has_issued &&
               a.issued_seq > seq) {
      parts.push_back(rs + " timed out in it and went on: " + what_it_last_did(a));
    } else if (here != nullptr) {
      waiting.push_back(r);  // running, or timed out just now as this rank did
      waiting_in.push_back(here);
    } else if (!a.has_issued || a.issued_seq < seq) {
      parts.push_back(rs + " has not reached this call: " + what_it_last_did(a));
    } else if (!a.entries.empty() && a.entries.front().seq > seq) {
      parts.push_back(rs + " issued it too long ago to be in its record: " + what_it_last_did(a));
    } else {
      parts.push_back(rs + " skipped this call: " + what_it_last_did(a));
    }
  }
  std::string s = head;
  for (std::size_t i = 0; i < parts.size(); ++i) s += (i ? "; " : "") + parts[i];
  if (!waiting.empty()) {
    s += std::string(parts.empty() ? "" : "; ") + rank_list(waiting) +
         (waiting.size() == 1 ? " is" : " are") + " waiting in " + op + " #" + std::to_string(seq);
    // Ranks that wait in one call but disagree on its root or size each wait for a message the
    // others will never send: say so, with what each of them was given.
    const auto differs = [&](auto field) {
      return std::any_of(waiting_in.begin(), waiting_in.end(),
                         [&](const Answer::Item* e) { return field(*e) != field(*waiting_in[0]); });
    };
    const bool roots = differs([](const Answer::Item& e) { return e.root; });
    // (Sizes only where every rank's output is the same size: gathers, scatters and all-to-alls
    // have ranks of different sizes by design.)
    const std::string o = op;
    const bool same_size = o == "allreduce" || o == "broadcast" || o == "reduce";
    const bool sizes = same_size && differs([](const Answer::Item& e) { return e.bytes; });
    if (roots || sizes) {
      s += std::string(", but their calls differ in ") + (roots ? "root" : "") +
           (roots && sizes ? " and " : "") + (sizes ? "size" : "") + " (";
      for (std::size_t i = 0; i < waiting.size(); ++i) {
        s += (i ? "; rank " : "rank ") + std::to_string(waiting[i]) + ": " +
             std::to_string(waiting_in[i]->bytes) + " bytes" +
             (waiting_in[i]->root >= 0 ? ", root " + std::to_string(waiting_in[i]->root) : "");
      }
      s += ")";
    }
  }
  if (!silent.empty()) {
    s += "; " + rank_list(silent) + " did not answer within " +
         std::to_string(kAnswerWait.count() / 1000) +
         " s (dead, stopped, or blocked in another call of this group)";
  }
  return s;
}

std::string FlightRecorder::json() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::ostringstream s;
  s << "{\"group\": " << json_string(group_) << ", \"rank\": " << rank_ << ", \"size\": " << size_
    << ", \"entries\": [";
  const std::uint64_t n = std::min<std::uint64_t>(count_, kCapacity);
  for (std::uint64_t i = count_ - n; i < count_; ++i) {
    const Entry& e = ring_[i % kCapacity];
    s << (i + n == count_ ? "" : ", ") << "{\"seq\": " << e.seq << ", \"op\": " << json_string(e.op)
      << ", \"bytes\": " << e.bytes << ", \"state\": \"" << state_name(e.state)
      << "\", \"issued_us\": " << e.issued_us << ", \"started_us\": " << e.started_us
      << ", \"finished_us\": " << e.finished_us;
    if (e.root >= 0) s << ", \"root\": " << e.root;
    s << "}";
  }
  s << "]}";
  return s.str();
}

bool FlightRecorder::dump_all(const std::string& why) {
  const std::string& dir = settings().trace_dump;
  if (dir.empty()) return false;
  std::string body;
  int rank = 0;
  {
    std::lock_guard<std::mutex> lk(registry_mu());
    rank = registry_rank() < 0 ? 0 : registry_rank();
    std::ostringstream s;
    s << "{\"version\": 1, \"pid\": " << ::getpid() << ", \"rank\": " << rank
      << ", \"reason\": " << json_string(why) << ", \"written_us\": " << now_us()
      << ", \"groups\": [";
    bool first = true;
    for (const FlightRecorder* r : registry()) {
      s << (first ? "" : ", ") << r->json();
      first = false;
    }
    s << "]}\n";
    body = s.str();
  }
  // Written next to the target and renamed over it: a reader never sees half a file.
  const std::string path = dump_path(rank);
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return false;
    out << body;
    if (!out.flush()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace commux::c10d_detail
