// Private to src/core (and tests/fuzz): TcpStore's wire format, parsed by one pure function.
//
//   request  = op:u8 keylen:u32 key [vallen:u32 value]      (value only for a set)
//   response = found:u8 [vallen:u32 value]                  (value only for a found get)
//   op: 1 set, 2 get, 3 check, 4 hello (key = the client's COMMUX_STORE_TOKEN; answered 1)
// Lengths are little-endian. A key (or token) is at most kStoreMaxKey bytes and a value at most
// kStoreMaxValue: a frame claiming more is malformed as soon as its length field has arrived, so
// the server never allocates for a length it has not accepted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace commux::detail {

inline constexpr std::size_t kStoreMaxKey = 4096;
inline constexpr std::size_t kStoreMaxValue = std::size_t{64} << 20;  // 64 MiB

enum class StoreOp : std::uint8_t { kSet = 1, kGet = 2, kCheck = 3, kHello = 4 };

struct StoreRequest {
  StoreOp op = StoreOp::kCheck;
  std::string key;  // the token for kHello
  std::vector<std::uint8_t> value;
};

struct StoreParse {
  enum Status : std::uint8_t { kNeedMore, kDone, kBad } status = kNeedMore;
  std::size_t consumed = 0;  // kDone: bytes of `data` the request took
  std::string error;         // kBad: what is wrong ("key length 4294967295 exceeds 4096")
};

// Parses the request at the start of data[0, n). kNeedMore: the frame is valid so far but
// incomplete; kDone: *out holds it; kBad: the frame can never become valid (close the connection).
StoreParse parse_store_request(const std::uint8_t* data, std::size_t n, StoreRequest* out);

// The bytes of a request (the inverse of parse_store_request). Lengths must be within the limits.
std::vector<std::uint8_t> encode_store_request(StoreOp op, const std::string& key,
                                               const std::vector<std::uint8_t>& value);

}  // namespace commux::detail
