// The debug log (see log.hpp): its level, its destination and the line prefix.
#include "log.hpp"

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <mutex>

#include "commux/settings.hpp"

namespace commux::log {

namespace detail {
std::atomic<int> g_level{-1};
}  // namespace detail

namespace {

struct Sink {
  std::mutex mu;
  bool opened = false;   // [mu] the destination was chosen
  std::string path;      // [mu] from COMMUX_DEBUG_FILE, "" = stderr
  FILE* file = nullptr;  // [mu] nullptr: stderr
};

Sink& sink() {
  static Sink* s = new Sink;  // never destroyed: usable from atexit handlers and late destructors
  return *s;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

// COMMUX_DEBUG_FILE with %h (host) and %p (pid) replaced.
std::string expand(const std::string& path) {
  std::string out;
  for (std::size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '%' && i + 1 < path.size() && (path[i + 1] == 'h' || path[i + 1] == 'p')) {
      out += path[i + 1] == 'h' ? host_name() : std::to_string(::getpid());
      ++i;
    } else {
      out += path[i];
    }
  }
  return out;
}

FILE* destination_locked(Sink& s) {
  if (!s.opened) {
    s.opened = true;
    if (!s.path.empty()) {
      const std::string p = expand(s.path);
      s.file = std::fopen(p.c_str(), "a");
      if (s.file == nullptr) {
        std::fprintf(stderr,
                     "commux WARN COMMUX_DEBUG_FILE='%s': cannot open %s; logging to stderr\n",
                     s.path.c_str(), p.c_str());
      }
    }
  }
  return s.file != nullptr ? s.file : stderr;
}

}  // namespace

int detail::init_level() noexcept {
  int l = 0;
  std::string path;
  try {
    const Settings& s = settings();
    l = s.debug;
    path = s.debug_file;
  } catch (...) {  // reported by the next reader of the settings
    l = 0;
  }
  {
    Sink& s = sink();
    std::lock_guard<std::mutex> g(s.mu);
    if (!s.opened) s.path = path;
  }
  int expected = -1;
  g_level.compare_exchange_strong(expected, l, std::memory_order_relaxed);
  return g_level.load(std::memory_order_relaxed);
}

const char* level_name(Level l) noexcept {
  switch (l) {
    case Level::kOff: return "OFF";
    case Level::kWarn: return "WARN";
    case Level::kInfo: return "INFO";
    case Level::kTrace: return "TRACE";
  }
  return "?";
}

bool parse_level(const std::string& text, Level* out) noexcept {
  std::string u;
  for (char c : text) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (Level l : {Level::kOff, Level::kWarn, Level::kInfo, Level::kTrace}) {
    if (u == level_name(l) || (u.empty() && l == Level::kOff)) {
      *out = l;
      return true;
    }
  }
  return false;
}

void write(Level l, int rank, const std::string& message) noexcept {
  try {
    static const std::string host = host_name();
    const std::string line = host + ":" + std::to_string(::getpid()) + " [rank " +
                             (rank >= 0 ? std::to_string(rank) : std::string("-")) + "] commux " +
                             level_name(l) + " " + message + "\n";
    Sink& s = sink();
    std::lock_guard<std::mutex> g(s.mu);
    FILE* f = destination_locked(s);
    std::fwrite(line.data(), 1, line.size(), f);
    std::fflush(f);
  } catch (...) {  // logging never fails an operation
  }
}

void reset_for_testing(Level l, const std::string& path) {
  Sink& s = sink();
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.file != nullptr) std::fclose(s.file);
    s.file = nullptr;
    s.opened = false;
    s.path = path;
  }
  detail::g_level.store(static_cast<int>(l), std::memory_order_relaxed);
}

}  // namespace commux::log
