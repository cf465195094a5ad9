// ProcessGroupUCX::allreduce of a sparse COO tensor (its Impl's allreduce_sparse), the way Gloo
// does it: every rank gathers every rank's indices and values, adds the ranks' sparse tensors in
// rank order and coalesces the sum, which then replaces the input (indices, values and nnz
// change). Only ReduceOp.SUM, as in Gloo; host memory only.
//
// On the wire, three collectives on the task's tags tag, tag + 1, tag + 2:
//   1. allgather of a fixed header per rank, int64 [ndim, sparse_dim, nnz, dtype];
//   2. allgatherv of int64 [sizes (ndim), indices (sparse_dim x nnz, row-major)] per rank;
//   3. allgatherv of the values (nnz x dense sizes) per rank.
// Every rank checks what it gathered the same way, so ranks whose tensors disagree (dimensions,
// sizes, dtype) all fail at the same step, naming the first rank that differs from rank 0, and
// nobody is left waiting for a collective the others skipped.
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>
#include <vector>

#include "commux/collectives.hpp"
#include "commux/error.hpp"
#include "errors.hpp"
#include "process_group_ucx_internal.hpp"
#include "tensor_checks.hpp"

namespace commux {

namespace {

constexpr const char* kOp = "allreduce";
constexpr int kHeader = 4;  // ndim, sparse_dim, nnz, dtype
constexpr std::uint32_t kSparseTags = 3;

[[noreturn]] void mismatch(const std::string& what, const std::string& where) {
  throw Error(Errc::kInvalidArgument,
              std::string("commux ") + kOp + " (sparse): " + what + " (" + where + ")");
}

// Byte counts and displacements of an allgatherv whose rank r contributes counts[r] elements of
// `elem` bytes each.
struct Layout {
  std::vector<std::size_t> bytes, displs;
  std::int64_t total = 0;  // elements
};

Layout layout_of(const std::vector<std::int64_t>& counts, std::size_t elem) {
  Layout l;
  for (const auto c : counts) {
    l.bytes.push_back(static_cast<std::size_t>(c) * elem);
    l.displs.push_back(static_cast<std::size_t>(l.total) * elem);
    l.total += c;
  }
  return l;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  using c10d_detail::invalid;
  if (tensors.size() != 1) {
    invalid(kOp, "expects exactly one tensor per process, got " + std::to_string(tensors.size()));
  }
  at::Tensor t = tensors[0];
  if (opts.reduceOp != c10d::ReduceOp::SUM) {
    invalid(kOp, "a sparse tensor can only be summed (ReduceOp.SUM), as in Gloo");
  }
  if (!t.device().is_cpu()) {
    invalid(kOp, "sparse tensors are supported on CPU only (got one on " + t.device().str() + ")");
  }
  const int size = getSize();
  const std::string group_text = where();
  return enqueue(
      c10d::OpType::ALLREDUCE, kOp, opts.timeout, opts.asyncOp, {}, tensors,
      [this, t, size, group_text](std::uint32_t tag, c10d_detail::Clock::time_point dl) mutable {
        const at::AutoDispatchBelowAutograd no_autograd;  // plain tensors, as in Gloo
        // What the calls send from and receive into, kept if one fails leaving transfers posted.
        c10d_detail::HeldOnFailure held(call(tag, kSparseTags));
        const at::Tensor in = t.coalesce();
        const at::Tensor idx = held(in._indices().contiguous());
        const at::Tensor val = held(in._values().contiguous());
        const std::int64_t nnz = in._nnz();

        // 1. headers
        const at::Tensor mine =
            held(at::tensor(std::vector<std::int64_t>{in.dim(), in.sparse_dim(), nnz,
                                                      static_cast<std::int64_t>(in.scalar_type())},
                            at::kLong));
        const at::Tensor heads_t = held(at::empty({size * kHeader}, at::kLong));
        const std::int64_t* heads = heads_t.data_ptr<std::int64_t>();
        coll::allgather(context(kOp, tag, dl, at::Tensor()), mine.data_ptr(),
                        kHeader * sizeof(std::int64_t), heads_t.data_ptr());
        auto head = [&](int r, int field) {
          return heads[static_cast<std::size_t>(r) * kHeader + field];
        };
        for (int r = 1; r < size; ++r) {
          if (head(r, 0) != head(0, 0) || head(r, 1) != head(0, 1)) {
            mismatch("rank " + std::to_string(r) + " has a " + std::to_string(head(r, 0)) +
                         "-dimensional tensor with " + std::to_string(head(r, 1)) +
                         " sparse dimensions but rank 0 one of " + std::to_string(head(0, 0)) +
                         " with " + std::to_string(head(0, 1)),
                     group_text);
          }
          if (head(r, 3) != head(0, 3)) {
            mismatch("rank " + std::to_string(r) + " has dtype " +
                         c10::toString(static_cast<c10::ScalarType>(head(r, 3))) + " but rank 0 " +
                         c10::toString(static_cast<c10::ScalarType>(head(0, 3))),
                     group_text);
          }
        }
        const std::int64_t ndim = in.dim(), sdim = in.sparse_dim();

        // 2. sizes and indices
        std::vector<std::int64_t> counts(size);
        for (int r = 0; r < size; ++r) counts[r] = ndim + sdim * head(r, 2);
        const Layout il = layout_of(counts, sizeof(std::int64_t));
        const at::Tensor send =
            held(at::cat({at::tensor(in.sizes().vec(), at::kLong), idx.reshape({-1})}));
        const at::Tensor ints = held(at::empty({il.total}, at::kLong));
        coll::allgatherv(context(kOp, tag + 1, dl, at::Tensor()), send.data_ptr(), ints.data_ptr(),
                         il.bytes.data(), il.displs.data());
        std::vector<at::Tensor> idxs;
        std::int64_t off = 0;
        for (int r = 0; r < size; ++r) {
          const at::Tensor sizes = ints.narrow(0, off, ndim);
          if (!at::equal(sizes, ints.narrow(0, 0, ndim))) {
            mismatch("rank " + std::to_string(r) + " has sizes " +
                         c10::str(c10::IntArrayRef(sizes.data_ptr<std::int64_t>(), ndim)) +
                         " but rank 0 " +
                         c10::str(c10::IntArrayRef(ints.data_ptr<std::int64_t>(), ndim)),
                     group_text);
          }
          idxs.push_back(ints.narrow(0, off + ndim, sdim * head(r, 2)).view({sdim, head(r, 2)}));
          off += counts[r];
        }

        // 3. values
        std::int64_t row = 1;  // elements per nonzero: the product of the dense sizes
        for (std::int64_t d = sdim; d < ndim; ++d) row *= in.size(d);
        std::vector<std::int64_t> vcounts(size);
        for (int r = 0; r < size; ++r) vcounts[r] = head(r, 2) * row;
        const Layout vl = layout_of(vcounts, val.element_size());
        const at::Tensor vals = held(at::empty({vl.total}, val.options()));
        coll::allgatherv(context(kOp, tag + 2, dl, at::Tensor()), val.data_ptr(), vals.data_ptr(),
                         vl.bytes.data(), vl.displs.data());

        // Sum in rank order, exactly as Gloo does, so both give the same bits.
        std::vector<std::int64_t> vshape = val.sizes().vec();
        at::Tensor out;
        std::int64_t voff = 0;
        for (int r = 0; r < size; ++r) {
          vshape[0] = head(r, 2);
          const at::Tensor part =
              at::sparse_coo_tensor(idxs[r], vals.narrow(0, voff, vcounts[r]).view(vshape),
                                    in.sizes(), in.options());
          voff += vcounts[r];
          if (r == 0) {
            out = part;
          } else {
            out += part;
          }
        }
        t.copy_(out.coalesce());
      },
      kSparseTags);
}

}  // namespace commux
