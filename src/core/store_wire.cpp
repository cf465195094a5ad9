// TcpStore's request parser and encoder (src/core/store_wire.hpp). No sockets, no UCX: the fuzzer
// (tests/fuzz/fuzz_store.cpp) calls it directly.
#include "store_wire.hpp"

namespace commux::detail {

namespace {

std::uint32_t load_u32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}

void store_u32(std::vector<std::uint8_t>* out, std::size_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

StoreParse bad(std::string why) {
  StoreParse r;
  r.status = StoreParse::kBad;
  r.error = std::move(why);
  return r;
}

}  // namespace

StoreParse parse_store_request(const std::uint8_t* data, std::size_t n, StoreRequest* out) {
  StoreParse more;
  if (n < 1) return more;
  const std::uint8_t op = data[0];
  if (op < 1 || op > 4) return bad("unknown request type " + std::to_string(op));
  if (n < 5) return more;
  const std::uint32_t keylen = load_u32(data + 1);
  if (keylen > kStoreMaxKey) {
    return bad((op == 4 ? "token length " : "key length ") + std::to_string(keylen) + " exceeds " +
               std::to_string(kStoreMaxKey));
  }
  std::size_t at = 5 + std::size_t{keylen};
  if (n < at) return more;
  std::uint32_t vallen = 0;
  if (op == static_cast<std::uint8_t>(StoreOp::kSet)) {
    if (n < at + 4) return more;
    vallen = load_u32(data + at);
    if (vallen > kStoreMaxValue) {
      return bad("value length " + std::to_string(vallen) + " exceeds " +
                 std::to_string(kStoreMaxValue));
    }
    at += 4;
    if (n < at + vallen) return more;
  }
  out->op = static_cast<StoreOp>(op);
  out->key.assign(reinterpret_cast<const char*>(data + 5), keylen);
  out->value.assign(data + at, data + at + vallen);
  StoreParse done;
  done.status = StoreParse::kDone;
  done.consumed = at + vallen;
  return done;
}

std::vector<std::uint8_t> encode_store_request(StoreOp op, const std::string& key,
                                               const std::vector<std::uint8_t>& value) {
  std::vector<std::uint8_t> out;
  out.reserve(1 + 4 + key.size() + (op == StoreOp::kSet ? 4 + value.size() : 0));
  out.push_back(static_cast<std::uint8_t>(op));
  store_u32(&out, key.size());
  out.insert(out.end(), key.begin(), key.end());
  if (op == StoreOp::kSet) {
    store_u32(&out, value.size());
    out.insert(out.end(), value.begin(), value.end());
  }
  return out;
}

}  // namespace commux::detail
