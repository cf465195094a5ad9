// commux/tag.hpp -- the one place that builds the 64-bit UCX tags commux puts on the wire.
//
//   63                  44 43          36   35   34   33   32 31                               0
//  +----------------------+--------------+----+----+----+----+----------------------------------+
//  |   sender rank (20)   | group id (8) | I  | C  | V  | N  |          user tag (32)           |
//  +----------------------+--------------+----+----+----+----+----------------------------------+
//
//  sender rank  rank of the sending process in its group, 0 .. 2^20-1. A receive from one peer
//               matches all 64 bits; a receive from any source masks this field out and reads the
//               real sender back from the tag UCX reports on completion.
//  group id     which communicator (process group) the message belongs to, so several groups can
//               share one UCX worker without cross-talk.
//  I            internal: set for traffic commux generates itself (collectives, barriers). User
//               point-to-point never sets it, so a user tag can never match a collective's message.
//  C            continuation: set on parts 1..n-1 of a multi-buffer message sent as separate UCX
//               messages. Any-source receives only match C=0, i.e. the first part of a message.
//  V            IOV: the message is a multi-buffer message packed into one UCX message. Receives
//               ignore this bit when matching and compare it on completion, so a peer that packs
//               when this rank does not (or the reverse) gets a clear wire-format error.
//  N            notice (with I set): a rank that rejected a collective, or stopped it on a cross-rank
//               mismatch, tells the other ranks (TagKind::kNotice; the user tag is the call's tag).
//  user tag     the 32-bit tag the user passed (0 .. 2^32-1; negative or larger tags are rejected
//               with Errc::kInvalidArgument); for internal traffic, the collective's call: the low
//               16 bits of its tag (Context::tag) and a 16-bit fingerprint of the call (operation,
//               algorithm, sizes, data type, root, reduce op), so that messages of two different
//               calls never match (see docs/architecture.md, "Cross-rank call checks").
//
// TagValue and TagMask are distinct types so that a mask can never be passed as a tag.
#pragma once

#include <cstdint>

namespace commux {

struct TagValue {
  std::uint64_t bits = 0;
  friend bool operator==(TagValue a, TagValue b) { return a.bits == b.bits; }
  friend bool operator!=(TagValue a, TagValue b) { return a.bits != b.bits; }
};
struct TagMask {
  std::uint64_t bits = 0;
};

namespace tag_layout {
inline constexpr int kUserBits = 32;
inline constexpr int kFlagShift = 32;  // N=32, V=33, C=34, I=35
inline constexpr int kGroupShift = 36;
inline constexpr int kGroupBits = 8;
inline constexpr int kRankShift = 44;
inline constexpr int kRankBits = 20;

inline constexpr std::uint64_t kUserMask = (std::uint64_t{1} << kUserBits) - 1;
inline constexpr std::uint64_t kNoticeBit = std::uint64_t{1} << 32;
inline constexpr std::uint64_t kIovBit = std::uint64_t{1} << 33;
inline constexpr std::uint64_t kContinuationBit = std::uint64_t{1} << 34;
inline constexpr std::uint64_t kInternalBit = std::uint64_t{1} << 35;
inline constexpr std::uint64_t kGroupMask = ((std::uint64_t{1} << kGroupBits) - 1) << kGroupShift;
inline constexpr std::uint64_t kRankMask = ((std::uint64_t{1} << kRankBits) - 1) << kRankShift;

inline constexpr std::int64_t kMaxUserTag = static_cast<std::int64_t>(kUserMask);
inline constexpr int kMaxRanks = 1 << kRankBits;
inline constexpr int kMaxGroups = 1 << kGroupBits;
}  // namespace tag_layout

// Whether a message is user point-to-point traffic or commux's own: a collective's data
// (kInternal) or a notice about a collective call (kNotice: I and N set).
enum class TagKind : std::uint8_t { kUser = 0, kInternal = 1, kNotice = 2 };

// How a message travels: one UCX message per buffer (first part C=0, the rest C=1), or all
// buffers packed into one UCX message with the IOV datatype (V=1).
enum class Packing : std::uint8_t { kParts = 0, kIov = 1 };

struct TagFields {
  int sender = 0;
  int group = 0;
  TagKind kind = TagKind::kUser;
  bool continuation = false;
  Packing packing = Packing::kParts;
  std::uint32_t user = 0;
};

// Builds a tag. Throws commux::Error(kInvalidArgument) if a field is out of range.
TagValue make_tag(const TagFields& f);
// Reads the fields back from a tag (inverse of make_tag).
TagFields parse_tag(TagValue t);
// Validates a user-supplied tag: 0 <= tag <= 2^32-1. `op` names the operation in the error.
std::uint32_t check_user_tag(std::int64_t tag, const char* op);

// Receive tag/mask pair. For a specific sender every field except V is matched; for any source
// the sender field is masked out too (C must still be 0: only first parts match).
struct RecvMatch {
  TagValue tag;
  TagMask mask;
};
RecvMatch recv_match(int sender_or_any, int group, TagKind kind, bool continuation,
                     std::uint32_t user);

}  // namespace commux
