// Private to src/core: the wait-for-a-key loop the stores share.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commux/error.hpp"

namespace commux::detail {

// Calls try_get() (returning std::optional<std::vector<uint8_t>>) with a backoff from 200 us to
// 20 ms until it yields a value or `timeout` passes; then throws Errc::kTimeout with
// "<who>: key '<key>' did not appear <where> within N ms <hint>".
template <typename TryGet>
std::vector<std::uint8_t> wait_for_key(const std::string& key, std::chrono::milliseconds timeout,
                                       const std::string& who, const std::string& where,
                                       const char* hint, TryGet try_get) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto backoff = std::chrono::microseconds(200);
  for (;;) {
    if (std::optional<std::vector<std::uint8_t>> v = try_get()) return std::move(*v);
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(Errc::kTimeout, "commux " + who + ": key '" + key + "' did not appear " + where +
                                      " within " + std::to_string(timeout.count()) + " ms " + hint);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(20000));
  }
}

}  // namespace commux::detail
