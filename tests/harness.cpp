#include "harness.hpp"

#include <arpa/inet.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

namespace commux::test {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

namespace {

void on_alarm(int) {
  static const char msg[] = "\n*** test child hung: watchdog fired; stack follows ***\n";
  [[maybe_unused]] ssize_t w = ::write(2, msg, sizeof(msg) - 1);
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(kHangExit);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) {
    const int code = WEXITSTATUS(status);
    if (code == kHangExit) return "hung (watchdog fired)";
    return "exit code " + std::to_string(code);
  }
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "unknown status";
}

}  // namespace

TempDir::TempDir(const char* prefix) {
  std::string tmpl = std::string("/tmp/") + prefix + "-XXXXXX";
  const char* d = ::mkdtemp(tmpl.data());
  if (d == nullptr)
    throw std::runtime_error("mkdtemp " + tmpl + " failed: " + std::strerror(errno));
  path_ = d;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {

// One world's children, forked and not yet reaped.
struct Spawned {
  std::string name;  // "" for a lone world, else how failures name the world
  int size = 0;
  RunOptions opts;
  std::unique_ptr<TempDir> dir;  // children leave with _exit: only the parent removes it
  std::vector<pid_t> pids;
  std::vector<int> status;  // -1 until reaped
};

void spawn(Spawned& w, const std::function<void(int, int, const std::string&)>& body) {
  std::fflush(nullptr);
  for (int r = 0; r < w.size; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << w.name << "fork failed";
      break;
    }
    if (pid == 0) {
      ::signal(SIGALRM, on_alarm);
      ::alarm(static_cast<unsigned>(w.opts.timeout_s));
      int code = 0;
      try {
        body(r, w.size, w.dir->path());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s[rank %d] FAILED: %s\n", w.name.c_str(), r, e.what());
        code = kFailExit;
      }
      std::fflush(nullptr);
      _exit(code);
    }
    w.pids.push_back(pid);
  }
  w.status.assign(w.pids.size(), -1);
}

// Reaps every child of every world, SIGKILLing those past their world's deadline, then reports
// each rank that did not end as expected.
void reap(std::vector<Spawned>& worlds) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    bool left = false;
    for (Spawned& w : worlds) {
      const auto deadline = start + std::chrono::seconds(w.opts.timeout_s + 5);
      for (std::size_t i = 0; i < w.pids.size(); ++i) {
        if (w.status[i] != -1) continue;
        int st = 0;
        if (::waitpid(w.pids[i], &st, WNOHANG) == w.pids[i]) {
          w.status[i] = st;
        } else if (std::chrono::steady_clock::now() > deadline) {
          ::kill(w.pids[i], SIGKILL);
          ::waitpid(w.pids[i], &w.status[i], 0);
          ADD_FAILURE() << w.name << "rank " << i << " did not finish within "
                        << w.opts.timeout_s + 5 << " s and was killed";
        } else {
          left = true;
        }
      }
    }
    if (!left) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (const Spawned& w : worlds) {
    for (std::size_t i = 0; i < w.pids.size(); ++i) {
      const int r = static_cast<int>(i);
      const int st = w.status[i];
      const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      const bool killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
      if (w.opts.expect_killed.count(r) != 0) {
        // A rank that was to kill itself and did not (it exited, even with 0) never ran the
        // part of the test its peers were checking.
        if (!killed) {
          ADD_FAILURE() << w.name << "rank " << r << " of " << w.size
                        << " was expected to be killed but "
                        << (ok ? "exited normally (exit code 0)" : describe_status(st));
        }
      } else if (!ok) {
        ADD_FAILURE() << w.name << "rank " << r << " of " << w.size << ": " << describe_status(st)
                      << " (its stderr above says why)";
      }
    }
  }
}

std::function<void(int, int, const std::string&)> with_communicator(
    const std::function<void(Communicator&)>& body, const RunOptions& opts) {
  return [&body, &opts](int rank, int n, const std::string& dir) {
    Options o = opts.comm_for_rank ? opts.comm_for_rank(rank) : opts.comm;
    Communicator comm(std::make_shared<FileStore>(dir), rank, n, o);
    body(comm);
  };
}

}  // namespace

void run_procs(int size, const std::function<void(int, int, const std::string&)>& body,
               RunOptions opts) {
  std::vector<Spawned> worlds(1);
  worlds[0].size = size;
  worlds[0].opts = std::move(opts);
  worlds[0].dir = std::make_unique<TempDir>();
  spawn(worlds[0], body);
  reap(worlds);
}

void run_ranks(int size, const std::function<void(Communicator&)>& body, RunOptions opts) {
  run_procs(size, with_communicator(body, opts), opts);
}

void run_worlds(const std::vector<World>& specs) {
  std::vector<Spawned> worlds(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    Spawned& w = worlds[i];
    w.name = "[" + specs[i].name + "] ";
    w.size = specs[i].size;
    w.opts = specs[i].opts;
    w.dir = std::make_unique<TempDir>();
    spawn(w, with_communicator(specs[i].body, specs[i].opts));
  }
  reap(worlds);
}

}  // namespace commux::test
