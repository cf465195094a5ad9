// libFuzzer target: TcpStore's request parser (src/core/store_wire.hpp) over arbitrary bytes, as a
// hostile client would send them. Besides crashes and ASan reports, it checks what the server
// relies on: a parsed request respects the limits, takes no more bytes than it was given, and
// encodes back to exactly those bytes; a prefix of a valid frame is never "bad" (the server keeps
// reading), and a bad frame says why.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "store_wire.hpp"

using commux::detail::encode_store_request;
using commux::detail::kStoreMaxKey;
using commux::detail::kStoreMaxValue;
using commux::detail::parse_store_request;
using commux::detail::StoreParse;
using commux::detail::StoreRequest;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::size_t at = 0;
  while (at < size) {  // as the server does: frame after frame from one stream
    StoreRequest req;
    const StoreParse p = parse_store_request(data + at, size - at, &req);
    if (p.status == StoreParse::kBad) {
      if (p.error.empty()) std::abort();  // the server logs why it closed the connection
      break;
    }
    if (p.status == StoreParse::kNeedMore) break;
    if (p.consumed == 0 || p.consumed > size - at) std::abort();
    if (req.key.size() > kStoreMaxKey || req.value.size() > kStoreMaxValue) std::abort();
    const std::vector<std::uint8_t> back = encode_store_request(req.op, req.key, req.value);
    if (back.size() != p.consumed) std::abort();
    for (std::size_t i = 0; i < back.size(); ++i) {
      if (back[i] != data[at + i]) std::abort();
    }
    // Every proper prefix of this frame is incomplete, never bad.
    for (std::size_t n = 0; n < p.consumed; n += 1 + p.consumed / 16) {
      StoreRequest part;
      if (parse_store_request(data + at, n, &part).status != StoreParse::kNeedMore) std::abort();
    }
    at += p.consumed;
  }
  return 0;
}
