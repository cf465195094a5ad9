// Polling for something that raises no event (a device stream's event, a post's gate): naps that
// grow by a quarter (and a microsecond) each, up to a cap; the progress thread's own idle polls
// grow the same way (grow_nap), with a cap that depends on what is in flight.
// The naps before the k-th add up to about four times it, so whatever the poll waits for is
// noticed late by at most about a quarter of the time waited so far, and never by more than the
// cap; a long wait settles at one poll per cap. (Doubling naps let a 1 ms cap be missed by up to
// the whole last nap: a stream that finished 40 us after a poll was seen up to 1 ms late.)
// Internal to commux (src/core, and src/c10d's device fences). Torch-free and UCX-free.
#pragma once

#include <algorithm>
#include <chrono>

namespace commux::detail {

// The cap of the polls for a device stream's event (a fence before a post or a collective): a
// stream whose work ends is seen within this, at about 4000 polls a second while one waits.
inline constexpr std::chrono::microseconds kEventPollCap{250};

// The nap after `nap`: a quarter (and a microsecond) longer, at most `cap`.
constexpr std::chrono::microseconds grow_nap(std::chrono::microseconds nap,
                                             std::chrono::microseconds cap) noexcept {
  return std::min(cap, nap + nap / 4 + std::chrono::microseconds(1));
}

class PollBackoff {
 public:
  constexpr PollBackoff(std::chrono::microseconds first, std::chrono::microseconds cap) noexcept
      : first_(first), cap_(std::max(cap, first)), nap_(first) {}
  // The nap to take now; the next one is a quarter longer.
  std::chrono::microseconds next() noexcept {
    const std::chrono::microseconds n = nap_;
    nap_ = grow_nap(nap_, cap_);
    return n;
  }
  // Something happened: the next nap is the first again.
  void reset() noexcept { nap_ = first_; }

 private:
  std::chrono::microseconds first_;
  std::chrono::microseconds cap_;
  std::chrono::microseconds nap_;
};

}  // namespace commux::detail
