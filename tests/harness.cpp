#include "harness.hpp"

#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
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

void run_procs(int size, const std::function<void(int, int, const std::string&)>& body,
               RunOptions opts) {
  const TempDir tmp;  // children leave with _exit: only the parent removes it
  const std::string& dir = tmp.path();
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      break;
    }
    if (pid == 0) {
      ::signal(SIGALRM, on_alarm);
      ::alarm(static_cast<unsigned>(opts.timeout_s));
      int code = 0;
      try {
        body(r, size, dir);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] FAILED: %s\n", r, e.what());
        code = kFailExit;
      }
      std::fflush(nullptr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(opts.timeout_s + 5);
  std::vector<int> status(pids.size(), -1);
  std::size_t left = pids.size();
  while (left > 0) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      if (::waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i) {
        if (status[i] == -1) {
          ::kill(pids[i], SIGKILL);
          ::waitpid(pids[i], &status[i], 0);
          ADD_FAILURE() << "rank " << i << " did not finish within " << opts.timeout_s + 5
                        << " s and was killed";
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (std::size_t i = 0; i < pids.size(); ++i) {
    const int r = static_cast<int>(i);
    const int st = status[i];
    const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    const bool killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
    if (opts.expect_killed.count(r) != 0) {
      // A rank that was to kill itself and did not (it exited, even with 0) never ran the part
      // of the test its peers were checking.
      if (!killed) {
        ADD_FAILURE() << "rank " << r << " of " << size << " was expected to be killed but "
                      << (ok ? "exited normally (exit code 0)" : describe_status(st));
      }
    } else if (!ok) {
      ADD_FAILURE() << "rank " << r << " of " << size << ": " << describe_status(st)
                    << " (its stderr above says why)";
    }
  }
  std::string cmd = "rm -rf '" + dir + "'";
  [[maybe_unused]] int rc = std::system(cmd.c_str());
}

void run_ranks(int size, const std::function<void(Communicator&)>& body, RunOptions opts) {
  run_procs(
      size,
      [&](int rank, int n, const std::string& dir) {
        Options o = opts.comm_for_rank ? opts.comm_for_rank(rank) : opts.comm;
        Communicator comm(std::make_shared<FileStore>(dir), rank, n, o);
        body(comm);
      },
      opts);
}

}  // namespace commux::test
