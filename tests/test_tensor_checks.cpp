// The torch adapter's argument checks (src/c10d/tensor_checks.hpp) and its dtype / ReduceOp
// tables (src/c10d/types.hpp), on tensors made here: each refusal is a c10::ValueError whose text
// names the operation, says what is wrong, and names the group of the GroupScope around it.
// Built only where the torch adapter is (tests/CMakeLists.txt: if(TARGET commux_c10d)); the same
// checks are driven through torch.distributed by python/tests/test_tensor_checks.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "errors.hpp"
#include "tensor_checks.hpp"
#include "types.hpp"

namespace cd = commux::c10d_detail;

namespace {

const std::string kGroup = "g7";

// The message of the ValueError `fn` throws inside a GroupScope of group g7, rank 1 of 4 (fails
// the test when it throws nothing or something else).
template <typename F>
std::string refusal(F&& fn) {
  const cd::GroupScope scope(kGroup, 1, 4);
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something else than c10::ValueError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "accepted";
  return "";
}

void expect_message(const std::string& msg, const std::string& op, const std::string& what) {
  EXPECT_NE(msg.find("commux " + op + ": "), std::string::npos) << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
  EXPECT_NE(msg.find("(group 'g7', rank 1 of 4)"), std::string::npos) << msg;
}

at::Tensor f32(int64_t n) { return at::ones({n}, at::kFloat); }

}  // namespace

TEST(TensorChecks, AcceptsValidTensors) {
  const cd::GroupScope scope(kGroup, 1, 4);
  EXPECT_NO_THROW(cd::check_tensor("allreduce", f32(5)));
  EXPECT_NO_THROW(cd::check_tensor("allreduce", at::empty({0}, at::kFloat)));
  EXPECT_NO_THROW(cd::check_same("allgather", f32(3), at::empty({3}, at::kFloat), "output tensor"));
  EXPECT_NO_THROW(cd::check_blocks("_allgather_base", f32(3), "input", f32(12), "output", 4));
  EXPECT_NO_THROW(cd::check_root("broadcast", 3, 4));
  EXPECT_NO_THROW(cd::check_p2p("send", {f32(2)}, 3, 4, true, 0));
  EXPECT_NO_THROW(cd::check_p2p("recvAnysource", {f32(2)}, -1, 4, false, 7));
}

TEST(TensorChecks, Contiguity) {
  expect_message(
      refusal([] { cd::check_tensor("allreduce", at::empty({4, 3}).t()); }), "allreduce",
      "tensor must be contiguous (sizes [3, 4], strides [1, 3]); call .contiguous() first");
  expect_message(refusal([] { cd::check_tensor("send", at::Tensor(), "input"); }), "send",
                 "input is undefined");
  expect_message(refusal([] { cd::check_tensor("broadcast", f32(4).to_sparse()); }), "broadcast",
                 "tensor must be dense (got a sparse tensor; only allreduce takes sparse COO "
                 "tensors)");
}

TEST(TensorChecks, DeviceCommuxCannotCarry) {
  expect_message(
      refusal([] { cd::check_tensor("broadcast", at::empty({2}, at::device(at::kMeta))); }),
      "broadcast", "tensor is on meta: commux carries CPU, CUDA, ROCm and Intel XPU tensors only");
}

TEST(TensorChecks, SingleAndSame) {
  expect_message(refusal([] { cd::single("allreduce", {f32(2), f32(2)}); }), "allreduce",
                 "expects exactly one tensor per process, got 2");
  expect_message(refusal([] { cd::check_same("allgather", f32(4), f32(3), "output tensor"); }),
                 "allgather", "output tensor has 3 elements but the input has 4");
  expect_message(refusal([] {
                   cd::check_same("allgather", f32(4), at::ones({4}, at::kDouble), "output tensor");
                 }),
                 "allgather", "output tensor has dtype Double but the input has Float");
}

TEST(TensorChecks, RootAndRootLists) {
  expect_message(refusal([] { cd::check_root("reduce", 4, 4); }), "reduce",
                 "root rank 4 is outside the group (size 4)");
  expect_message(refusal([] { cd::check_root("reduce", -1, 4); }), "reduce", "root rank -1");
  expect_message(refusal(
                     [] { cd::root_list("gather", {{f32(2)}}, f32(2), false, 0, 4, "output"); }),
                 "gather", "only the root (rank 0) takes output tensors");
  expect_message(refusal([] { cd::root_list("scatter", {{f32(2)}}, f32(2), true, 1, 4, "input"); }),
                 "scatter", "the root expects one input list of 4 tensors, got 1 tensors");
  const cd::GroupScope scope(kGroup, 1, 4);
  EXPECT_TRUE(cd::root_list("gather", {}, f32(2), false, 0, 4, "output").empty());
  EXPECT_EQ(cd::root_list("gather", {{f32(2), f32(2), f32(2), f32(2)}}, f32(2), true, 0, 4,
                          "output")
                .size(),
            4u);
}

TEST(TensorChecks, Blocks) {
  expect_message(refusal([] {
                   cd::check_blocks("_allgather_base", f32(4), "input", f32(6), "output", 4);
                 }),
                 "_allgather_base",
                 "output must have the input's dtype and 4 times its elements (input: 4 Float, "
                 "output: 6 Float)");
  expect_message(refusal([] {
                   cd::check_blocks_coalesced("allgather_into_tensor_coalesced", {f32(8)},
                                              {f32(2), f32(2)}, 4, true);
                 }),
                 "allgather_into_tensor_coalesced", "needs one output per input");
  expect_message(refusal([] {
                   cd::check_blocks_coalesced("reduce_scatter_tensor_coalesced", {f32(2)}, {f32(4)},
                                              4, false);
                 }),
                 "reduce_scatter_tensor_coalesced",
                 "input 0 must have the output 0's dtype and 4 times");
}

TEST(TensorChecks, PointToPoint) {
  expect_message(refusal([] { cd::check_p2p("send", {}, 0, 4, true, 0); }), "send",
                 "needs at least one tensor");
  expect_message(refusal([] { cd::check_p2p("send", {f32(1)}, 4, 4, true, 0); }), "send",
                 "destination rank 4 is outside the group");
  expect_message(refusal([] { cd::check_p2p("recv", {f32(1)}, -2, 4, false, 0); }), "recv",
                 "source rank -2 is outside the group");
  expect_message(refusal([] { cd::check_p2p("recv", {f32(1)}, 0, 4, false, -1); }), "recv",
                 "tag -1 is negative; tags are 0 .. 2^31-1");
}

TEST(TensorChecks, Lists) {
  expect_message(refusal([] {
                   cd::check_coalesced("allreduce_coalesced", {f32(2), at::ones({2}, at::kDouble)});
                 }),
                 "allreduce_coalesced", "all tensors must have one dtype");
  expect_message(refusal([] { cd::check_coalesced("allreduce_coalesced", {}); }),
                 "allreduce_coalesced", "needs at least one tensor");
  expect_message(refusal([] {
                   cd::check_allgather_outputs("allgather", {{f32(2)}, {f32(2)}}, f32(2), 4);
                 }),
                 "allgather", "expects one output list of 4 tensors, got 2 lists");
  expect_message(refusal([] {
                   cd::check_allgather_coalesced("allgather_coalesced", {{f32(2)}}, {f32(2)}, 4);
                 }),
                 "allgather_coalesced", "expects 4 output lists, got 1");
  expect_message(refusal([] {
                   cd::check_reduce_scatter_inputs("reduce_scatter", {{f32(2)}}, f32(2), 4);
                 }),
                 "reduce_scatter", "expects one input list of 4 tensors");
  expect_message(refusal([] {
                   cd::check_alltoall_base("alltoall_base", f32(4), at::ones({4}, at::kDouble));
                 }),
                 "alltoall_base", "input and output dtypes differ");
  expect_message(refusal([] { cd::check_alltoall("alltoall", {f32(1), f32(1)}, {f32(1)}, 4); }),
                 "alltoall", "expects 4 input and output tensors, got 1 and 2");
}

TEST(TensorChecks, SplitSizes) {
  std::vector<std::size_t> counts, displs;
  expect_message(
      refusal([&] { cd::split_bytes("alltoall_base", "input", f32(6), {}, 4, counts, displs); }),
      "alltoall_base", "input has 6 rows, not divisible by the group size 4; pass split sizes");
  expect_message(refusal([&] {
                   cd::split_bytes("alltoall_base", "output", f32(4), {4}, 4, counts, displs);
                 }),
                 "alltoall_base", "output split sizes have 1 entries but the group has 4 ranks");
  expect_message(refusal([&] {
                   cd::split_bytes("alltoall_base", "input", f32(4), {2, 2, 1, -1}, 4, counts,
                                   displs);
                 }),
                 "alltoall_base", "input split sizes contain a negative entry");
  expect_message(refusal([&] {
                   cd::split_bytes("alltoall_base", "input", f32(4), {2, 2, 1, 0}, 4, counts,
                                   displs);
                 }),
                 "alltoall_base", "input split sizes add up to 5 but the tensor has 4 rows");
  // Entries that add up to 2^64 + 4, which wraps around to the 4 rows: before, accepted, with
  // 2^63 bytes for rank 0.
  constexpr int64_t kHuge = int64_t{3} << 61;
  expect_message(refusal([&] {
                   cd::split_bytes("alltoall_base", "input", f32(4),
                                   {kHuge, kHuge, int64_t{1} << 62, 4}, 4, counts, displs);
                 }),
                 "alltoall_base",
                 "input split size 6917529027641081856 (for rank 0) exceeds the tensor's 4 rows");
  expect_message(refusal([&] {
                   cd::split_bytes("alltoall_base", "input", at::ones({}), {}, 4, counts, displs);
                 }),
                 "alltoall_base", "input must have at least one dimension");
  // Accepted: bytes and displacements of rows of 3 floats.
  const cd::GroupScope scope(kGroup, 1, 4);
  cd::split_bytes("alltoall_base", "input", at::ones({4, 3}), {0, 1, 2, 1}, 4, counts, displs);
  EXPECT_EQ(counts, (std::vector<std::size_t>{0, 12, 24, 12}));
  EXPECT_EQ(displs, (std::vector<std::size_t>{0, 0, 12, 36}));
}

TEST(Types, DtypeTableRoundTrips) {
  const cd::GroupScope scope(kGroup, 1, 4);
  for (const at::ScalarType s :
       {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kShort, at::kInt,
        at::kLong, at::kByte, at::kBool, at::kComplexFloat, at::kComplexDouble}) {
    EXPECT_EQ(cd::scalar_type(cd::to_dtype("allreduce", s)), s) << c10::toString(s);
  }
  EXPECT_EQ(cd::to_dtype("allreduce", at::kBFloat16), commux::DataType::kBFloat16);
  expect_message(refusal([] { cd::to_dtype("allreduce", at::kUInt16); }), "allreduce",
                 "dtype UInt16 is not supported for reductions");
}

TEST(Types, ReduceOpTable) {
  {
    const cd::GroupScope scope(kGroup, 1, 4);
    EXPECT_EQ(cd::to_reduction("allreduce", c10d::ReduceOp(c10d::ReduceOp::MAX), at::kInt).op,
              commux::ReduceOp::kMax);
    const cd::Reduction avg =
        cd::to_reduction("allreduce", c10d::ReduceOp(c10d::ReduceOp::AVG), at::kFloat);
    EXPECT_EQ(avg.op, commux::ReduceOp::kSum);
    EXPECT_TRUE(avg.average);
    EXPECT_STREQ(cd::c10d_op_name(c10d::ReduceOp::PREMUL_SUM), "PREMUL_SUM");
    EXPECT_STREQ(cd::c10d_op_name(c10d::ReduceOp::UNUSED), "UNUSED");
  }
  expect_message(refusal([] {
                   cd::to_reduction("reduce", c10d::ReduceOp(c10d::ReduceOp::AVG), at::kInt);
                 }),
                 "reduce",
                 "ReduceOp AVG needs a floating-point or complex tensor, got int32 (use SUM and "
                 "divide yourself)");
  expect_message(refusal([] {
                   cd::to_reduction("reduce", c10d::ReduceOp(c10d::ReduceOp::UNUSED), at::kInt);
                 }),
                 "reduce", "ReduceOp UNUSED is not supported");
  expect_message(refusal([] {
                   cd::to_reduction("allreduce", c10d::ReduceOp(c10d::ReduceOp::BAND), at::kFloat);
                 }),
                 "allreduce", "BAND");
}
