// Builders for the tag layout drawn in include/commux/tag.hpp.
#include "commux/tag.hpp"

#include <string>

#include "commux/error.hpp"

namespace commux {

using namespace tag_layout;

TagValue make_tag(const TagFields& f) {
  if (f.sender < 0 || f.sender >= kMaxRanks) {
    throw Error(Errc::kInvalidArgument, "commux tag: sender rank " + std::to_string(f.sender) +
                                            " is outside 0.." + std::to_string(kMaxRanks - 1));
  }
  if (f.group < 0 || f.group >= kMaxGroups) {
    throw Error(Errc::kInvalidArgument, "commux tag: group id " + std::to_string(f.group) +
                                            " is outside 0.." + std::to_string(kMaxGroups - 1));
  }
  std::uint64_t bits = std::uint64_t{f.user};
  bits |= static_cast<std::uint64_t>(f.sender) << kRankShift;
  bits |= static_cast<std::uint64_t>(f.group) << kGroupShift;
  if (f.kind == TagKind::kInternal) bits |= kInternalBit;
  if (f.kind == TagKind::kNotice) bits |= kInternalBit | kNoticeBit;
  if (f.continuation) bits |= kContinuationBit;
  if (f.packing == Packing::kIov) bits |= kIovBit;
  return TagValue{bits};
}

TagFields parse_tag(TagValue t) {
  TagFields f;
  f.user = static_cast<std::uint32_t>(t.bits & kUserMask);
  f.sender = static_cast<int>((t.bits & kRankMask) >> kRankShift);
  f.group = static_cast<int>((t.bits & kGroupMask) >> kGroupShift);
  f.kind = !(t.bits & kInternalBit) ? TagKind::kUser
           : (t.bits & kNoticeBit)  ? TagKind::kNotice
                                    : TagKind::kInternal;
  f.continuation = (t.bits & kContinuationBit) != 0;
  f.packing = (t.bits & kIovBit) ? Packing::kIov : Packing::kParts;
  return f;
}

std::uint32_t check_user_tag(std::int64_t tag, const char* op) {
  if (tag < 0 || tag > kMaxUserTag) {
    throw Error(Errc::kInvalidArgument,
                std::string("commux ") + op + ": tag " + std::to_string(tag) +
                    " is outside the supported range 0.." + std::to_string(kMaxUserTag) +
                    " (negative tags are reserved; tags are 32-bit)");
  }
  return static_cast<std::uint32_t>(tag);
}

RecvMatch recv_match(int sender_or_any, int group, TagKind kind, bool continuation,
                     std::uint32_t user) {
  const bool any = sender_or_any < 0;
  TagFields f;
  f.sender = any ? 0 : sender_or_any;
  f.group = group;
  f.kind = kind;
  f.continuation = continuation;
  f.user = user;
  RecvMatch m;
  m.tag = make_tag(f);
  std::uint64_t mask = ~std::uint64_t{0};
  mask &= ~kIovBit;  // compared after completion, so a mismatch is an error rather than a hang
  if (any) mask &= ~kRankMask;
  m.mask = TagMask{mask};
  return m;
}

}  // namespace commux
