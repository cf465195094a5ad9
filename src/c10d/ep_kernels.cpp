// The row work under commux.ep: routing, packing and unpacking (see ep_kernels.hpp).
#include "ep_kernels.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

namespace commux::ep {

namespace {

[[noreturn]] void bad(const std::string& what) {
  C10_THROW_ERROR(ValueError, "commux ep: " + what);
}

// Bytes of one row (dimension 0) of a tensor, whatever its dtype and rank.
std::int64_t row_bytes(const at::Tensor& t) {
  std::int64_t n = static_cast<std::int64_t>(t.element_size());
  for (std::int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// A tensor's bytes as a [rows, row bytes] uint8 view (the tensor must be contiguous).
at::Tensor byte_rows(const at::Tensor& t) {
  return t.contiguous().view({t.size(0), -1}).view(at::kByte).view({t.size(0), row_bytes(t)});
}

std::int64_t total(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

}  // namespace

Route route(const at::Tensor& topk_idx, std::int64_t num_experts, std::int64_t ranks,
            bool per_assignment) {
  Route r;
  const std::int64_t E = num_experts, R = ranks;
  if (E <= 0) {
    r.error = "num_experts=" + std::to_string(E) + " must be positive";
    return r;
  }
  if (R <= 0 || E % R != 0) {
    r.error = "num_experts=" + std::to_string(E) + " is not a multiple of the group size " + std::to_string(R);
    return r;
  }
  if (!topk_idx.defined() || topk_idx.dim() != 2) {
    r.error = "topk_idx must be a 2-D [tokens, k] integer tensor";
    return r;
  }
  if (at::isFloatingType(topk_idx.scalar_type()) || at::isComplexType(topk_idx.scalar_type()) ||
      topk_idx.scalar_type() == at::kBool) {
    r.error = std::string("topk_idx must be an integer tensor, got ") + c10::toString(topk_idx.scalar_type());
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
                    " twice in its top-k (slots " + std::to_string(i) + " and " + std::to_string(j) + ")";
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

at::Tensor pack(const at::Tensor& headers, const std::vector<at::Tensor>& parts,
                const std::vector<std::int64_t>& offsets, const at::Tensor& index,
                const std::vector<at::Tensor>& row_parts, const std::vector<std::int64_t>& row_offsets,
                const std::vector<std::int64_t>& counts, std::int64_t stride) {
  const auto R = static_cast<std::int64_t>(counts.size());
  if (!headers.defined() || headers.scalar_type() != at::kByte || headers.dim() != 2 ||
      headers.size(0) != R || !headers.is_contiguous() || !headers.device().is_cpu()) {
    bad("pack: headers must be a contiguous [ranks, bytes] uint8 host tensor");
  }
  if (parts.size() != offsets.size() || row_parts.size() != row_offsets.size()) {
    bad("pack: one offset per part");
  }
  const std::int64_t hb = headers.size(1);
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
    if (p.device() != device && (indexed || !device.is_cpu())) {
      bad("pack: the parts must be on one device");
    }
    const std::int64_t nb = row_bytes(p);
    if (off < 0 || off + nb > stride) {
      bad("pack: field " + std::to_string(f) + " (" + std::to_string(nb) + " bytes at offset " +
          std::to_string(off) + ") does not fit a row of " + std::to_string(stride) + " bytes");
    }
    fields.push_back({indexed ? p.contiguous() : p.to(device).contiguous(), nb, off, indexed});
  }
  const bool identity = !index.defined();
  if (identity ? S > T : (index.numel() != S || index.scalar_type() != at::kLong || !index.device().is_cpu())) {
    bad("pack: the row index must be a host int64 tensor of one entry per row sent");
  }
  at::Tensor out = at::empty({R * hb + S * stride}, at::TensorOptions().dtype(at::kByte).device(device));
  if (device.is_cpu()) {
    const auto* hd = headers.data_ptr<std::uint8_t>();
    const at::Tensor idx = identity ? at::Tensor() : index.contiguous();
    const std::int64_t* ix = identity ? nullptr : idx.data_ptr<std::int64_t>();
    std::vector<const std::uint8_t*> src;
    for (const auto& f : fields) src.push_back(static_cast<const std::uint8_t*>(f.t.data_ptr()));
    auto* o = out.data_ptr<std::uint8_t>();
    std::int64_t row = 0;
    for (std::int64_t p = 0; p < R; ++p) {
      std::memcpy(o, hd + p * hb, static_cast<std::size_t>(hb));
      o += hb;
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
  at::Tensor rows = at::zeros({S, stride}, out.options());
  const at::Tensor dix = identity ? at::Tensor() : index.to(device);
  for (const auto& f : fields) {
    if (f.nbytes == 0) continue;
    const at::Tensor b = byte_rows(f.t);
    const at::Tensor sel = !f.indexed ? b : identity ? b.narrow(0, 0, S) : b.index_select(0, dix);
    rows.narrow(1, f.offset, f.nbytes).copy_(sel);
  }
  const at::Tensor hdev = headers.to(device);
  std::int64_t pos = 0, row = 0;
  for (std::int64_t p = 0; p < R; ++p) {
    const std::int64_t n = counts[static_cast<std::size_t>(p)];
    out.narrow(0, pos, hb).copy_(hdev[p]);
    out.narrow(0, pos + hb, n * stride).copy_(rows.narrow(0, row, n).reshape({-1}));
    pos += hb + n * stride;
    row += n;
  }
  return out;
}

at::Tensor headers(const at::Tensor& recv, const std::vector<std::int64_t>& slot_offsets,
                   const std::vector<std::int64_t>& received, std::int64_t header_bytes) {
  const auto R = static_cast<std::int64_t>(slot_offsets.size());
  if (header_bytes % 8 != 0 || received.size() != slot_offsets.size()) bad("headers: bad sizes");
  at::Tensor out = at::zeros({R, header_bytes / 8}, at::TensorOptions().dtype(at::kLong));
  for (std::int64_t p = 0; p < R; ++p) {
    if (received[static_cast<std::size_t>(p)] < header_bytes) continue;
    out[p].view(at::kByte).copy_(recv.narrow(0, slot_offsets[static_cast<std::size_t>(p)], header_bytes));
  }
  return out;
}

std::vector<at::Tensor> unpack(const at::Tensor& recv, const std::vector<std::int64_t>& slot_offsets,
                               const std::vector<std::int64_t>& rows, std::int64_t header_bytes,
                               std::int64_t stride, const std::vector<std::int64_t>& offsets,
                               const std::vector<std::int64_t>& sizes) {
  const std::int64_t N = total(rows);
  if (rows.size() != slot_offsets.size() || offsets.size() != sizes.size()) bad("unpack: bad sizes");
  for (std::size_t p = 0; p < rows.size(); ++p) {
    if (rows[p] < 0 || slot_offsets[p] + header_bytes + rows[p] * stride > recv.numel()) {
      bad("unpack: rows of rank " + std::to_string(p) + " lie outside the received buffer");
    }
  }
  for (std::size_t f = 0; f < sizes.size(); ++f) {
    if (offsets[f] < 0 || offsets[f] + sizes[f] > stride) bad("unpack: a field does not fit a row");
  }
  std::vector<at::Tensor> out;
  if (recv.device().is_cpu()) {
    const auto* base = recv.data_ptr<std::uint8_t>();
    std::vector<std::uint8_t*> dst;
    for (const auto s : sizes) {
      out.push_back(at::empty({N, s}, recv.options()));
      dst.push_back(out.back().data_ptr<std::uint8_t>());
    }
    for (std::size_t p = 0; p < rows.size(); ++p) {
      const std::uint8_t* r = base + slot_offsets[p] + header_bytes;
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
    blocks.push_back(recv.narrow(0, slot_offsets[p] + header_bytes, rows[p] * stride).view({rows[p], stride}));
  }
  const at::Tensor all = blocks.empty() ? at::empty({0, stride}, recv.options()) : at::cat(blocks);
  for (std::size_t f = 0; f < sizes.size(); ++f) out.push_back(all.narrow(1, offsets[f], sizes[f]).contiguous());
  return out;
}

}  // namespace commux::ep
