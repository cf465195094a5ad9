// libFuzzer target: the tag decoder (include/commux/tag.hpp) over arbitrary 64-bit tags, as UCX
// reports them on completion. parse_tag must read any tag; rebuilding it with make_tag gives the
// same bits except the reserved bit R, which make_tag never sets; each field is in its range; and
// the receive match built from the fields matches the tag (any-source too, for first parts).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "commux/tag.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < sizeof(std::uint64_t)) return 0;
  std::uint64_t bits = 0;
  std::memcpy(&bits, data, sizeof(bits));
  namespace L = commux::tag_layout;
  const commux::TagFields f = commux::parse_tag(commux::TagValue{bits});
  if (f.sender < 0 || f.sender >= L::kMaxRanks || f.group < 0 || f.group >= L::kMaxGroups)
    std::abort();
  const commux::TagValue back = commux::make_tag(f);
  // N (notice) is only meaningful with I (internal): without it the tag is user traffic.
  const std::uint64_t expect = (bits & L::kInternalBit) ? bits : (bits & ~L::kNoticeBit);
  if (back.bits != expect) std::abort();
  for (const int sender : {f.sender, -1}) {
    if (sender < 0 && f.continuation) continue;  // any-source matches first parts only
    const commux::RecvMatch m = commux::recv_match(sender, f.group, f.kind, f.continuation, f.user);
    if (((back.bits ^ m.tag.bits) & m.mask.bits) != 0) std::abort();
  }
  return 0;
}
