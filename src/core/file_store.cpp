#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>

#include "commux/error.hpp"
#include "commux/store.hpp"
#include "store_wait.hpp"

namespace commux {

namespace {

void make_dirs(const std::string& dir) {
  std::string partial;
  for (std::size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      partial = dir.substr(0, i);
      if (::mkdir(partial.c_str(), 0777) != 0 && errno != EEXIST) {
        throw Error(Errc::kInvalidArgument, "commux FileStore: cannot create directory '" +
                                                partial + "': " + std::strerror(errno));
      }
    }
  }
}

}  // namespace

FileStore::FileStore(std::string dir) : dir_(std::move(dir)) {
  if (dir_.empty()) throw Error(Errc::kInvalidArgument, "commux FileStore: empty directory name");
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  make_dirs(dir_);
}

std::string FileStore::path_of(const std::string& key) const {
  // Keys may contain '/', which we flatten; anything unusual is hex-escaped so two keys never
  // share a file.
  std::string name;
  static const char* hex = "0123456789abcdef";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
      name.push_back(static_cast<char>(c));
    } else {
      name.push_back('%');
      name.push_back(hex[c >> 4]);
      name.push_back(hex[c & 15]);
    }
  }
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const std::vector<std::uint8_t>& value) {
  const std::string path = path_of(key);
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(value.data()),
              static_cast<std::streamsize>(value.size()));
    if (!out) {
      throw Error(Errc::kInvalidArgument, "commux FileStore: cannot write '" + tmp + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error(Errc::kInvalidArgument,
                "commux FileStore: cannot publish key '" + key + "': " + std::strerror(e));
  }
}

bool FileStore::check(const std::string& key) { return ::access(path_of(key).c_str(), F_OK) == 0; }

std::vector<std::uint8_t> FileStore::get(const std::string& key,
                                         std::chrono::milliseconds timeout) {
  const std::string path = path_of(key);
  return detail::wait_for_key(key, timeout, "FileStore", "in '" + dir_ + "'",
                              "(is every rank started, with the same store?)",
                              [&]() -> std::optional<std::vector<std::uint8_t>> {
                                std::ifstream in(path, std::ios::binary);
                                if (!in) return std::nullopt;
                                return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(in),
                                                                 std::istreambuf_iterator<char>());
                              });
}

}  // namespace commux
