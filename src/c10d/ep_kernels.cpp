// The row work under commux.ep: routing, packing and unpacking (see ep_kernels.hpp).
#include "ep_kernels.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string>

#include "errors.hpp"

namespace commux::ep {

namespace {

std::atomic<bool> aten_on_host{false};

// Host memory is handled with plain loops, unless set_aten_on_host(true) asks for the ATen path
// there too (so CI runs the device path's code without a device).
bool loops(const c10::Device& d) {
  return d.is_cpu() && !aten_on_host.load(std::memory_order_relaxed);
}

[[noreturn]] void bad(const std::string& what) {
  c10d_detail::throw_value_error("commux ep: " + what);
}

// Bytes of one row (dimension 0) of a tensor, whatever its dtype and rank.
std::int64_t row_bytes(const at::Tensor& t) {
  std::int64_t n = static_cast<std::int64_t>(t.element_size());
  for (std::int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// A tensor's bytes as a [rows, row bytes] uint8 view (the tensor must be contiguous).
at::Tensor byte_rows(const at::Tensor& t) {
  const std::int64_t elems = row_bytes(t) / static_cast<std::int64_t>(t.element_size());
  return t.contiguous().view({t.size(0), elems}).view(at::kByte);
}

// The two hot loops get AVX2 and AVX-512 versions beside the baseline one, picked at load time
// (GCC's target_clones): the wheel is built for any x86-64, the machine running it may do more.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define COMMUX_EP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define COMMUX_EP_CLONES
#endif

// a[h] += float(x[h]) for bf16 x (possibly unaligned): the widening is a shift, so this loop
// vectorizes.
COMMUX_EP_CLONES void add_bf16(float* a, const std::uint8_t* x, std::int64_t n) {
  for (std::int64_t h = 0; h < n; ++h) {
    std::uint16_t b;
    std::memcpy(&b, x + 2 * h, 2);
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    a[h] += f;
  }
}

// float -> bf16, rounding to nearest even as torch does (NaN stays NaN).
COMMUX_EP_CLONES void to_bf16(std::uint16_t* out, const float* a, std::size_t n) {
  for (std::size_t q = 0; q < n; ++q) {
    std::uint32_t u;
    std::memcpy(&u, a + q, 4);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    u += 0x7fffu + ((u >> 16) & 1u);
    out[q] = nan ? static_cast<std::uint16_t>(0x7fc0) : static_cast<std::uint16_t>(u >> 16);
  }
}

std::int64_t total(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

}  // namespace

void set_aten_on_host(bool on) { aten_on_host.store(on); }

Route route(const at::Tensor& topk_idx, std::int64_t num_experts, std::int64_t ranks,
            bool per_assignment) {
  Route r;
  const std::int64_t E = num_experts, R = ranks;
  if (E <= 0) {
    r.error = "num_experts=" + std::to_string(E) + " must be positive";
    return r;
  }
  if (R <= 0 || E % R != 0) {
    r.error = "num_experts=" + std::to_string(E) + " is not a multiple of the group size " +
              std::to_string(R);
    return r;
  }
  if (!topk_idx.defined() || topk_idx.dim() != 2) {
    r.error = "topk_idx must be a 2-D [tokens, k] integer tensor";
    return r;
  }
  if (at::isFloatingType(topk_idx.scalar_type()) || at::isComplexType(topk_idx.scalar_type()) ||
      topk_idx.scalar_type() == at::kBool) {
    r.error = std::string("topk_idx must be an integer tensor, got ") +
              c10::toString(topk_idx.scalar_type());
    return r;
  }
  const at::Tensor idx = topk_idx.to(at::kCPU, at::kLong).contiguous();
  const std::int64_t T = idx.size(0), k = idx.size(1), epr = E / R;
  const std::int64_t* v = idx.data_ptr<std::int64_t>();
  r.in_rank = at::zeros({T, R}, at::TensorOptions().dtype(at::kBool));
  r.per_expert = at::zeros({E}, at::TensorOptions().dtype(at::kInt));
  bool* in_rank = r.in_rank.data_ptr<bool>();
  std::int32_t* per_expert = r.per_expert.data_ptr<std::int32_t>();
  std::vector<std::vector<std::int64_t>> tok(static_cast<std::size_t>(R)), slot;
  std::vector<std::vector<std::int32_t>> expert;
  if (per_assignment) {
    slot.resize(static_cast<std::size_t>(R));
    expert.resize(static_cast<std::size_t>(R));
  }
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t* row = v + t * k;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = row[j];
      if (e == -1) continue;
      if (e < -1 || e >= E) {
        r.error = "top-k id " + std::to_string(e) + " of token " + std::to_string(t) + " (slot " +
                  std::to_string(j) + ") is outside [-1, " + std::to_string(E) + ")";
        return r;
      }
      for (std::int64_t i = 0; i < j; ++i) {
        if (row[i] == e) {
          r.error = "token " + std::to_string(t) + " names expert " + std::to_string(e) +
                    " twice in its top-k (slots " + std::to_string(i) + " and " +
                    std::to_string(j) + ")";
          return r;
        }
      }
      ++per_expert[e];
      const std::int64_t d = e / epr;
      const auto du = static_cast<std::size_t>(d);
      if (per_assignment) {
        tok[du].push_back(t);
        slot[du].push_back(j);
        expert[du].push_back(static_cast<std::int32_t>(e));
      } else if (!in_rank[t * R + d]) {
        in_rank[t * R + d] = true;
        tok[du].push_back(t);
      }
    }
  }
  std::int64_t S = 0;
  for (const auto& x : tok) {
    r.counts.push_back(static_cast<std::int64_t>(x.size()));
    S += static_cast<std::int64_t>(x.size());
  }
  r.token = at::empty({S}, at::TensorOptions().dtype(at::kLong));
  std::int64_t* tp = r.token.data_ptr<std::int64_t>();
  std::int64_t* sp = nullptr;
  std::int32_t* ep = nullptr;
  if (per_assignment) {
    r.slot = at::empty({S}, at::TensorOptions().dtype(at::kLong));
    r.expert = at::empty({S}, at::TensorOptions().dtype(at::kInt));
    sp = r.slot.data_ptr<std::int64_t>();
    ep = r.expert.data_ptr<std::int32_t>();
  }
  for (std::size_t d = 0; d < tok.size(); ++d) {
    tp = std::copy(tok[d].begin(), tok[d].end(), tp);
    if (per_assignment) {
      sp = std::copy(slot[d].begin(), slot[d].end(), sp);
      ep = std::copy(expert[d].begin(), expert[d].end(), ep);
    }
  }
  return r;
}

at::Tensor pack(const std::vector<at::Tensor>& parts, const std::vector<std::int64_t>& offsets,
                const at::Tensor& index, const std::vector<at::Tensor>& row_parts,
                const std::vector<std::int64_t>& row_offsets,
                const std::vector<std::int64_t>& counts, std::int64_t stride) {
  const auto R = static_cast<std::int64_t>(counts.size());
  if (parts.size() != offsets.size() || row_parts.size() != row_offsets.size()) {
    bad("pack: one offset per part");
  }
  const std::int64_t S = total(counts);
  const std::int64_t T = parts.empty() ? S : parts[0].size(0);
  c10::Device device(at::kCPU);
  if (!parts.empty()) device = parts[0].device();
  // Every field: its source tensor, bytes a row, offset in the row, and whether it is indexed.
  struct Field {
    at::Tensor t;
    std::int64_t nbytes, offset;
    bool indexed;
  };
  std::vector<Field> fields;
  for (std::size_t f = 0; f < parts.size() + row_parts.size(); ++f) {
    const bool indexed = f < parts.size();
    const at::Tensor& p = indexed ? parts[f] : row_parts[f - parts.size()];
    const std::int64_t off = indexed ? offsets[f] : row_offsets[f - parts.size()];
    if (p.dim() == 0 || p.size(0) != (indexed ? T : S)) {
      bad("pack: field " + std::to_string(f) + " has the wrong number of rows");
    }
    // The indexed parts (the caller's per-token tensors) share a device, where the rows are
    // built; row parts (the route's host tensors: source rows, expert ids) are moved there.
    if (indexed && p.device() != device) {
      bad("pack: the per-token parts must be on one device (part " + std::to_string(f) + " is on " +
          p.device().str() + ", part 0 on " + device.str() + ")");
    }
    const std::int64_t nb = row_bytes(p);
    if (off < 0 || off + nb > stride) {
      bad("pack: field " + std::to_string(f) + " (" + std::to_string(nb) + " bytes at offset " +
          std::to_string(off) + ") does not fit a row of " + std::to_string(stride) + " bytes");
    }
    fields.push_back({indexed ? p.contiguous() : p.to(device).contiguous(), nb, off, indexed});
  }
  const bool identity = !index.defined();
  if (identity
          ? S > T
          : (index.numel() != S || index.scalar_type() != at::kLong || !index.device().is_cpu())) {
    bad("pack: the row index must be a host int64 tensor of one entry per row sent");
  }
  if (loops(device)) {
    at::Tensor out = at::empty({S * stride}, at::TensorOptions().dtype(at::kByte));
    const at::Tensor idx = identity ? at::Tensor() : index.contiguous();
    const std::int64_t* ix = identity ? nullptr : idx.data_ptr<std::int64_t>();
    std::vector<const std::uint8_t*> src;
    for (const auto& f : fields) src.push_back(static_cast<const std::uint8_t*>(f.t.data_ptr()));
    auto* o = out.data_ptr<std::uint8_t>();
    std::int64_t row = 0;
    for (std::int64_t p = 0; p < R; ++p) {
      for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(p)]; ++i, ++row, o += stride) {
        const std::int64_t s = identity ? row : ix[row];
        if (s < 0 || s >= T) bad("pack: row index " + std::to_string(s) + " out of range");
        std::memset(o, 0, static_cast<std::size_t>(stride));
        for (std::size_t f = 0; f < fields.size(); ++f) {
          const std::int64_t r = fields[f].indexed ? s : row;
          std::memcpy(o + fields[f].offset, src[f] + r * fields[f].nbytes,
                      static_cast<std::size_t>(fields[f].nbytes));
        }
      }
    }
    return out;
  }
  at::Tensor rows = at::zeros({S, stride}, at::TensorOptions().dtype(at::kByte).device(device));
  const at::Tensor dix = identity ? at::Tensor() : index.to(device);
  for (const auto& f : fields) {
    if (f.nbytes == 0) continue;
    const at::Tensor b = byte_rows(f.t);
    const at::Tensor sel = !f.indexed ? b : identity ? b.narrow(0, 0, S) : b.index_select(0, dix);
    rows.narrow(1, f.offset, f.nbytes).copy_(sel);
  }
  return rows.reshape({-1});
}

at::Tensor make_headers(const std::vector<std::int64_t>& fields, const std::string& reason,
                        std::int64_t header_ints, std::int64_t rows_at, std::int64_t bytes_at,
                        const std::vector<std::int64_t>& counts, std::int64_t stride) {
  const auto nf = static_cast<std::int64_t>(fields.size());
  if (nf > header_ints || rows_at < 0 || rows_at >= nf || bytes_at < 0 || bytes_at >= nf) {
    bad("make_headers: the fields do not fit a header");
  }
  const auto R = static_cast<std::int64_t>(counts.size());
  at::Tensor out = at::zeros({R, header_ints * 8}, at::TensorOptions().dtype(at::kByte));
  auto* o = out.data_ptr<std::uint8_t>();
  const std::size_t text =
      std::min<std::size_t>(reason.size(), static_cast<std::size_t>((header_ints - nf) * 8));
  std::vector<std::int64_t> row(fields);
  for (std::int64_t p = 0; p < R; ++p, o += header_ints * 8) {
    row[static_cast<std::size_t>(rows_at)] = counts[static_cast<std::size_t>(p)];
    row[static_cast<std::size_t>(bytes_at)] = counts[static_cast<std::size_t>(p)] * stride;
    std::memcpy(o, row.data(), row.size() * sizeof(std::int64_t));
    std::memcpy(o + nf * 8, reason.data(), text);
  }
  return out;
}

Headers read_headers(const at::Tensor& recv, const std::vector<std::int64_t>& slot_offsets,
                     const std::vector<std::int64_t>& received, std::int64_t header_bytes,
                     std::int64_t fields) {
  if (received.size() != slot_offsets.size() || fields * 8 > header_bytes)
    bad("read_headers: bad sizes");
  Headers h;
  const at::Tensor host = recv.device().is_cpu() ? recv : at::Tensor();
  std::vector<std::uint8_t> one(static_cast<std::size_t>(header_bytes));
  for (std::size_t p = 0; p < slot_offsets.size(); ++p) {
    h.fields.emplace_back(static_cast<std::size_t>(fields), 0);
    h.reasons.emplace_back();
    if (received[p] < header_bytes) continue;
    if (slot_offsets[p] < 0 || slot_offsets[p] + header_bytes > recv.numel())
      bad("read_headers: slot outside the buffer");
    if (host.defined()) {
      std::memcpy(one.data(), host.data_ptr<std::uint8_t>() + slot_offsets[p], one.size());
    } else {
      at::Tensor t = recv.narrow(0, slot_offsets[p], header_bytes).cpu();
      std::memcpy(one.data(), t.data_ptr<std::uint8_t>(), one.size());
    }
    std::memcpy(h.fields.back().data(), one.data(), static_cast<std::size_t>(fields) * 8);
    std::size_t n = one.size();
    while (n > static_cast<std::size_t>(fields * 8) && one[n - 1] == 0) --n;
    h.reasons.back().assign(reinterpret_cast<const char*>(one.data()) + fields * 8,
                            n - static_cast<std::size_t>(fields * 8));
  }
  return h;
}

std::vector<at::Tensor> unpack(const at::Tensor& recv,
                               const std::vector<std::int64_t>& slot_offsets,
                               const std::vector<std::int64_t>& rows, std::int64_t stride,
                               const std::vector<std::int64_t>& offsets,
                               const std::vector<std::int64_t>& sizes) {
  const std::int64_t N = total(rows);
  if (rows.size() != slot_offsets.size() || offsets.size() != sizes.size())
    bad("unpack: bad sizes");
  for (std::size_t p = 0; p < rows.size(); ++p) {
    if (rows[p] < 0 || slot_offsets[p] + rows[p] * stride > recv.numel()) {
      bad("unpack: rows of rank " + std::to_string(p) + " lie outside the received buffer");
    }
  }
  for (std::size_t f = 0; f < sizes.size(); ++f) {
    if (offsets[f] < 0 || offsets[f] + sizes[f] > stride) bad("unpack: a field does not fit a row");
  }
  std::vector<at::Tensor> out;
  if (loops(recv.device())) {
    const auto* base = recv.data_ptr<std::uint8_t>();
    std::vector<std::uint8_t*> dst;
    for (const auto s : sizes) {
      out.push_back(at::empty({N, s}, recv.options()));
      dst.push_back(out.back().data_ptr<std::uint8_t>());
    }
    for (std::size_t p = 0; p < rows.size(); ++p) {
      const std::uint8_t* r = base + slot_offsets[p];
      for (std::int64_t i = 0; i < rows[p]; ++i, r += stride) {
        for (std::size_t f = 0; f < sizes.size(); ++f) {
          std::memcpy(dst[f], r + offsets[f], static_cast<std::size_t>(sizes[f]));
          dst[f] += sizes[f];
        }
      }
    }
    return out;
  }
  std::vector<at::Tensor> blocks;
  for (std::size_t p = 0; p < rows.size(); ++p) {
    blocks.push_back(recv.narrow(0, slot_offsets[p], rows[p] * stride).view({rows[p], stride}));
  }
  const at::Tensor all = blocks.empty() ? at::empty({0, stride}, recv.options()) : at::cat(blocks);
  for (std::size_t f = 0; f < sizes.size(); ++f)
    out.push_back(all.narrow(1, offsets[f], sizes[f]).contiguous());
  return out;
}

LocalIds local_ids(const at::Tensor& gid, const at::Tensor& weights, std::int64_t lo,
                   std::int64_t experts_here, std::int64_t alignment) {
  if (gid.scalar_type() != at::kInt || gid.dim() != 2) bad("local_ids: ids must be [N, k] int32");
  if (alignment < 1) bad("local_ids: alignment must be >= 1");
  LocalIds out;
  out.per_expert.assign(static_cast<std::size_t>(experts_here), 0);
  if (!loops(gid.device())) {
    const at::Tensor mine = (gid >= lo).logical_and(gid < lo + experts_here);
    out.local = at::where(mine, gid - lo, -1).to(at::kLong);
    if (weights.defined()) weights.masked_fill_(mine.logical_not(), 0.0);
    const at::Tensor counts = at::bincount(out.local.reshape({-1}) + 1, {}, experts_here + 1)
                                  .narrow(0, 1, experts_here)
                                  .cpu();
    const auto* c = counts.data_ptr<std::int64_t>();
    for (std::int64_t e = 0; e < experts_here; ++e)
      out.per_expert[e] = (c[e] + alignment - 1) / alignment * alignment;
    return out;
  }
  const at::Tensor g = gid.contiguous();
  const std::int64_t n = g.numel();
  out.local = at::empty(g.sizes(), g.options().dtype(at::kLong));
  const auto* gp = g.data_ptr<std::int32_t>();
  auto* lp = out.local.data_ptr<std::int64_t>();
  float* wp = nullptr;
  if (weights.defined()) {
    if (weights.scalar_type() != at::kFloat || !weights.is_contiguous() || weights.numel() != n) {
      bad("local_ids: weights must be contiguous float32 of the ids' shape");
    }
    wp = weights.data_ptr<float>();
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t e = static_cast<std::int64_t>(gp[i]) - lo;
    if (e >= 0 && e < experts_here) {
      lp[i] = e;
      ++out.per_expert[static_cast<std::size_t>(e)];
    } else {
      lp[i] = -1;
      if (wp) wp[i] = 0.0f;
    }
  }
  for (auto& c : out.per_expert) c = (c + alignment - 1) / alignment * alignment;
  return out;
}

std::vector<at::Tensor> combine_sum(const at::Tensor& x, const at::Tensor& weights,
                                    const at::Tensor& order, std::int64_t tokens) {
  if (x.scalar_type() != at::kBFloat16 || x.dim() != 2)
    bad("combine_sum: rows must be [S, H] bfloat16");
  const std::int64_t N = x.size(0), H = x.size(1);
  const bool w = weights.defined();
  if (w && (weights.scalar_type() != at::kFloat || weights.dim() != 2 || weights.size(0) != N)) {
    bad("combine_sum: weights must be [S, k] float32");
  }
  const std::int64_t k = w ? weights.size(1) : 0;
  if (!order.device().is_cpu() || order.scalar_type() != at::kLong || order.numel() != N) {
    bad("combine_sum: order must be a host int64 tensor of one entry per row");
  }
  const at::Tensor ord = order.contiguous();
  const auto* op = ord.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < N; ++i) {
    if (op[i] < 0 || op[i] >= tokens) bad("combine_sum: a row's token is out of range");
  }
  if (!loops(x.device())) {
    const at::Tensor dord = ord.to(x.device());
    at::Tensor acc = at::zeros({tokens, H}, x.options().dtype(at::kFloat));
    acc.index_add_(0, dord, x.to(at::kFloat));
    at::Tensor wsum;
    if (w) {
      wsum = at::zeros({tokens, k}, x.options().dtype(at::kFloat));
      wsum.index_add_(0, dord, weights);
    }
    return {acc.to(at::kBFloat16), wsum};
  }
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w ? weights.contiguous() : at::Tensor();
  const auto* xb = static_cast<const std::uint8_t*>(xc.data_ptr());
  const float* wp = w ? wc.data_ptr<float>() : nullptr;
  // Rows by token (a CSR over the rows), then each token's sum in a small float32 block that
  // stays in L1, cast to bf16 as it is written: one read of every row, one write of the result.
  // Within a token the rows keep their order (the ranks' order), as a float32 index_add would.
  std::vector<std::int64_t> start(static_cast<std::size_t>(tokens) + 1, 0);
  for (std::int64_t i = 0; i < N; ++i) ++start[static_cast<std::size_t>(op[i]) + 1];
  for (std::int64_t t = 0; t < tokens; ++t) start[t + 1] += start[t];
  std::vector<std::int64_t> row_of(static_cast<std::size_t>(N));
  {
    std::vector<std::int64_t> fill(start.begin(), start.end() - 1);
    for (std::int64_t i = 0; i < N; ++i) row_of[fill[op[i]]++] = i;
  }
  at::Tensor out = at::empty({tokens, H}, at::TensorOptions().dtype(at::kBFloat16));
  auto* o = static_cast<std::uint16_t*>(out.data_ptr());
  at::Tensor wsum;
  float* wo = nullptr;
  if (w) {
    wsum = at::zeros({tokens, k}, at::TensorOptions().dtype(at::kFloat));
    wo = wsum.data_ptr<float>();
  }
  constexpr std::int64_t kBlock = 512;
  float block[kBlock];
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t h0 = 0; h0 < H; h0 += kBlock) {
      const std::int64_t m = std::min(kBlock, H - h0);
      std::fill(block, block + m, 0.0f);
      for (std::int64_t q = start[t]; q < start[t + 1]; ++q)
        add_bf16(block, xb + (row_of[q] * H + h0) * 2, m);
      to_bf16(o + t * H + h0, block, static_cast<std::size_t>(m));
    }
    for (std::int64_t q = start[t]; w && q < start[t + 1]; ++q) {
      for (std::int64_t c = 0; c < k; ++c) wo[t * k + c] += wp[row_of[q] * k + c];
    }
  }
  return {out, wsum};
}

Placed ll_place(const std::vector<at::Tensor>& rows, const at::Tensor& expert,
                const at::Tensor& src, const std::vector<std::int64_t>& recv_counts,
                std::int64_t lo, std::int64_t experts_here, std::int64_t slots) {
  const std::int64_t N = total(recv_counts);
  const auto R = static_cast<std::int64_t>(recv_counts.size());
  const std::int64_t E = experts_here;
  if (expert.numel() != N || src.numel() != N || expert.scalar_type() != at::kInt ||
      src.scalar_type() != at::kInt) {
    bad("ll_place: expert and src must be int32, one per row");
  }
  for (const auto& r : rows) {
    if (r.dim() != 2 || r.size(0) != N || r.scalar_type() != at::kByte)
      bad("ll_place: rows must be [N, bytes] uint8");
  }
  const c10::Device dev = expert.device();
  const auto opts = at::TensorOptions().device(dev);
  Placed out;
  // The slot of every row, on the host (the counts are needed there anyway).
  const at::Tensor e_host = expert.to(at::kCPU).contiguous();
  const auto* ep = e_host.data_ptr<std::int32_t>();
  std::vector<std::int64_t> count(static_cast<std::size_t>(E), 0),
      per(static_cast<std::size_t>(E * R), 0);
  out.gather = at::empty({N}, at::TensorOptions().dtype(at::kLong));
  auto* gp = out.gather.data_ptr<std::int64_t>();
  std::int64_t i = 0;
  for (std::int64_t p = 0; p < R; ++p) {
    for (std::int64_t j = 0; j < recv_counts[static_cast<std::size_t>(p)]; ++j, ++i) {
      const std::int64_t e = static_cast<std::int64_t>(ep[i]) - lo;
      if (e < 0 || e >= E)
        bad("ll_place: rank " + std::to_string(p) + " sent a row for expert " +
            std::to_string(ep[i]) + ", which is not on this rank");
      const std::int64_t pos = count[static_cast<std::size_t>(e)]++;
      if (pos >= slots)
        bad("ll_place: more rows for one expert than its " + std::to_string(slots) + " slots");
      gp[i] = e * slots + pos;
      ++per[static_cast<std::size_t>(e * R + p)];
    }
  }
  at::Tensor cnt = at::empty({E}, at::TensorOptions().dtype(at::kLong));
  at::Tensor lr = at::empty({E, R}, at::TensorOptions().dtype(at::kLong));
  auto* cp = cnt.data_ptr<std::int64_t>();
  auto* lp = lr.data_ptr<std::int64_t>();
  for (std::int64_t e = 0; e < E; ++e) {
    cp[e] = count[static_cast<std::size_t>(e)];
    std::int64_t begin = 0;
    for (std::int64_t p = 0; p < R; ++p) {
      const std::int64_t c = per[static_cast<std::size_t>(e * R + p)];
      lp[e * R + p] = (begin << 32) | c;
      begin += c;
    }
  }
  out.count = cnt.to(dev);
  out.layout_range = lr.to(dev);
  if (loops(dev)) {
    out.src_info = at::full({E, slots}, -1, opts.dtype(at::kInt));
    auto* sp = out.src_info.data_ptr<std::int32_t>();
    const at::Tensor s_host = src.contiguous();
    const auto* sv = s_host.data_ptr<std::int32_t>();
    for (std::int64_t q = 0; q < N; ++q) sp[gp[q]] = sv[q];
    for (const auto& r : rows) {
      const std::int64_t nb = r.size(1);
      at::Tensor o = at::empty({E, slots, nb}, opts.dtype(at::kByte));
      const at::Tensor rc = r.contiguous();
      const auto* rp = rc.data_ptr<std::uint8_t>();
      auto* op = o.data_ptr<std::uint8_t>();
      for (std::int64_t q = 0; q < N; ++q)
        std::memcpy(op + gp[q] * nb, rp + q * nb, static_cast<std::size_t>(nb));
      out.rows.push_back(o);
    }
    return out;
  }
  const at::Tensor g = out.gather.to(dev);
  out.src_info = at::full({E * slots}, -1, opts.dtype(at::kInt));
  out.src_info.index_copy_(0, g, src.reshape({-1}));
  out.src_info = out.src_info.view({E, slots});
  for (const auto& r : rows) {
    at::Tensor o = at::empty({E * slots, r.size(1)}, opts.dtype(at::kByte));
    o.index_copy_(0, g, r);
    out.rows.push_back(o.view({E, slots, r.size(1)}));
  }
  return out;
}

}  // namespace commux::ep
