// src/c10d/ep_kernels.hpp -- the row work under commux.ep (expert-parallel dispatch and combine),
// so that a dispatch or combine costs a handful of calls from Python instead of dozens of small
// tensor operations. Internal: bound for python/commux/ep.py only.
//
// An exchange moves rows in lanes (see ProcessGroupUCX::exchange_lanes): the payload rows as they
// are, and a lane of small per-row fields (source row, expert ids, weights, scales) packed at
// fixed byte offsets of a `stride`-byte row, which pack() writes and unpack() reads. Host memory is
// handled with plain loops; device tensors with ATen operations on their current stream (same
// layout).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace commux::ep {

// Runs the device path (ATen operations) on host tensors too: a check of that path on a machine
// without a device (COMMUX_EP_ATEN=1 in commux.ep; off by default).
void set_aten_on_host(bool on);

// Validation and layout of one dispatch's routing. `error` is empty when the routing is valid;
// otherwise it says what is wrong and the other members are undefined.
struct Route {
  std::string error;
  std::vector<std::int64_t> counts;  // rows for each destination rank
  at::Tensor token;       // [S] int64: the source token of each row, rows by destination rank
  at::Tensor slot;        // [S] int64 (per_assignment only): the top-k slot of each row
  at::Tensor expert;      // [S] int32 (per_assignment only): the global expert id of each row
  at::Tensor in_rank;     // [T, R] bool: whether token t goes to rank r
  at::Tensor per_expert;  // [E] int32: how many tokens chose each expert
};
// topk_idx: [T, k] integer, -1 for an empty slot, ids distinct within a token. per_assignment:
// one row per (token, expert) ordered by destination rank, token, slot (low-latency mode);
// otherwise one row per (token, destination rank) ordered by destination rank, token (normal
// mode). A device topk_idx is copied to the host (the counts are needed there anyway); the
// returned tensors are on the host.
Route route(const at::Tensor& topk_idx, std::int64_t num_experts, std::int64_t ranks,
            bool per_assignment);

// The headers of one exchange's messages, one row of `header_ints` int64 per destination rank:
// `fields` first, with fields[rows_at] = counts[p] and fields[bytes_at] = counts[p] * stride,
// then `reason` (UTF-8, cut to fit) in the bytes after the fields. A [R, header_ints * 8] uint8
// host tensor.
at::Tensor make_headers(const std::vector<std::int64_t>& fields, const std::string& reason,
                        std::int64_t header_ints, std::int64_t rows_at, std::int64_t bytes_at,
                        const std::vector<std::int64_t>& counts, std::int64_t stride);

// The packed lane of one exchange: counts[p] rows of `stride` bytes for each rank p, in rank
// order. Row i holds, for every field f, row index[i] of parts[f] (a [T, ...] tensor: its row's
// bytes) at byte offset offsets[f], and row i of row_parts[g] (an [S, ...] tensor) at
// row_offsets[g]; the rest of the row is zero. `index` (host int64 [S]) undefined means rows
// 0, 1, 2, ... On the device of the parts (the host when there are none).
at::Tensor pack(const std::vector<at::Tensor>& parts, const std::vector<std::int64_t>& offsets,
                const at::Tensor& index, const std::vector<at::Tensor>& row_parts,
                const std::vector<std::int64_t>& row_offsets,
                const std::vector<std::int64_t>& counts, std::int64_t stride);

// The headers of a received buffer: for each rank, its first `fields` int64 and the reason text
// after them (trailing zero bytes dropped); a rank that sent fewer bytes than a header (received
// < header_bytes, e.g. -1) gets zeros and no text (which no check accepts).
struct Headers {
  std::vector<std::vector<std::int64_t>> fields;
  std::vector<std::string> reasons;
};
Headers read_headers(const at::Tensor& recv, const std::vector<std::int64_t>& slot_offsets,
                     const std::vector<std::int64_t>& received, std::int64_t header_bytes,
                     std::int64_t fields);

// The fields of the rows of a received packed lane, grouped by source rank in rank order: rows[p]
// rows start at slot_offsets[p]. Returns one [N, sizes[f]] uint8 tensor per field.
std::vector<at::Tensor> unpack(const at::Tensor& recv,
                               const std::vector<std::int64_t>& slot_offsets,
                               const std::vector<std::int64_t>& rows, std::int64_t stride,
                               const std::vector<std::int64_t>& offsets,
                               const std::vector<std::int64_t>& sizes);

// Normal dispatch, receive side: global expert ids ([N, k] int32) to local ids (id - lo where
// lo <= id < lo + experts_here, else -1), as int64; zeroes weights ([N, k] float32, may be
// undefined) in place where the id is not local; and counts each local expert's rows, rounded up
// to `alignment`.
struct LocalIds {
  at::Tensor local;
  std::vector<std::int64_t> per_expert;
};
LocalIds local_ids(const at::Tensor& gid, const at::Tensor& weights, std::int64_t lo,
                   std::int64_t experts_here, std::int64_t alignment);

// Normal combine, back at the source: sums the rows that came back ([S, H] bfloat16, row i for
// token order[i]) into [T, H] per token, in float32, cast once to bfloat16; with weights ([S, k]
// float32, may be undefined) also their [T, k] sums (else that result is undefined).
std::vector<at::Tensor> combine_sum(const at::Tensor& x, const at::Tensor& weights,
                                    const at::Tensor& order, std::int64_t tokens);

// Low-latency dispatch, receive side: places the N arrived rows (grouped by source rank, recv
// counts[p] from rank p; rows[f] are [N, bytes_f] uint8 payloads, expert[N] int32 global ids on
// this rank, src[N] int32 source tokens) into each local expert's slots from the start, in
// arrival order (by source rank, then token).
struct Placed {
  std::vector<at::Tensor> rows;  // [experts_here, slots, bytes_f] uint8; unwritten beyond counts
  at::Tensor src_info;           // [experts_here, slots] int32, -1 where no row
  at::Tensor count;              // [experts_here] int64
  at::Tensor layout_range;       // [experts_here, R] int64: (begin << 32) | count per source rank
  at::Tensor gather;             // [N] int64, host: expert * slots + slot of every arrived row
};
Placed ll_place(const std::vector<at::Tensor>& rows, const at::Tensor& expert,
                const at::Tensor& src, const std::vector<std::int64_t>& recv_counts,
                std::int64_t lo, std::int64_t experts_here, std::int64_t slots);

}  // namespace commux::ep
