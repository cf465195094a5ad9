// How the list forms of the collectives (all_gather, gather, scatter, reduce_scatter, all_to_all
// with tensor lists) stage a list as one flat buffer (src/c10d/list_buffer.hpp): the list's own
// memory where its tensors lie back to back in order and apart from the call's other tensor, else
// a staging buffer that pack() and unpack() fill and empty. python/tests/test_collectives.py
// (test_list_layouts) runs the same layouts through torch.distributed and checks the results.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "list_buffer.hpp"

namespace cd = commux::c10d_detail;

namespace {

std::vector<std::size_t> sizes_of(const std::vector<at::Tensor>& list) {
  std::vector<std::size_t> out;
  for (const auto& t : list) out.push_back(t.numel() * t.element_size());
  return out;
}

std::vector<at::Tensor> rows(const at::Tensor& whole) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < whole.size(0); ++i) out.push_back(whole[i]);
  return out;
}

}  // namespace

TEST(ListBuffer, TheRowsOfOneTensorAreUsedInPlace) {
  const at::Tensor whole = at::arange(12, at::kFloat).reshape({3, 4});
  const auto list = rows(whole);
  const auto bytes = sizes_of(list);
  const at::Tensor other = at::zeros({4}, at::kFloat);
  cd::ListBuffer buf({}, list, bytes, other, other.data_ptr(), 16);
  EXPECT_TRUE(buf.in_place());
  EXPECT_EQ(buf.data(), whole.data_ptr());
  EXPECT_EQ(buf.displs(), (std::vector<std::size_t>{0, 16, 32}));
}

TEST(ListBuffer, RowsOutOfOrderAreStagedAndCopiedBothWays) {
  const at::Tensor whole = at::arange(12, at::kFloat).reshape({3, 4});
  auto list = rows(whole);
  std::swap(list[0], list[2]);  // adjacent, but not in list order
  const auto bytes = sizes_of(list);
  const at::Tensor other = at::zeros({4}, at::kFloat);
  cd::ListBuffer buf({}, list, bytes, other, other.data_ptr(), 16);
  ASSERT_FALSE(buf.in_place());
  buf.pack();
  const auto* staged = static_cast<const float*>(buf.data());
  EXPECT_EQ(staged[0], 8.0F);  // list[0] is row 2
  EXPECT_EQ(staged[4], 4.0F);
  EXPECT_EQ(staged[8], 0.0F);
  auto* writable = static_cast<float*>(buf.data());
  for (int i = 0; i < 12; ++i) writable[i] = static_cast<float>(100 + i);
  buf.unpack();
  EXPECT_EQ(whole[2][0].item<float>(), 100.0F);
  EXPECT_EQ(whole[0][3].item<float>(), 111.0F);
}

TEST(ListBuffer, ABlockThatOverlapsTheOtherTensorIsStaged) {
  const at::Tensor whole = at::zeros({3, 4}, at::kFloat);
  const auto list = rows(whole);
  const auto bytes = sizes_of(list);
  // A scatter whose output is the root's own input row, or an all_to_all whose lists share memory.
  cd::ListBuffer buf({}, list, bytes, whole, list[1].data_ptr(), 16);
  EXPECT_FALSE(buf.in_place());
  // Where the call allows its own row (in == out + rank * bytes, the gathers), it stays in place,
  // but not for another rank's row or a range that straddles rows.
  cd::ListBuffer own({}, list, bytes, whole, list[1].data_ptr(), 16, /*own=*/1);
  EXPECT_TRUE(own.in_place());
  cd::ListBuffer wrong_row({}, list, bytes, whole, list[1].data_ptr(), 16, /*own=*/2);
  EXPECT_FALSE(wrong_row.in_place());
  cd::ListBuffer straddles({}, list, bytes, whole, static_cast<char*>(list[1].data_ptr()) + 4, 16,
                           1);
  EXPECT_FALSE(straddles.in_place());
}

TEST(ListBuffer, UnevenAndEmptyElementsKeepTheirPlaces) {
  const at::Tensor whole = at::arange(10, at::kFloat);
  const std::vector<at::Tensor> list = {whole.narrow(0, 0, 3), whole.narrow(0, 3, 0),
                                        whole.narrow(0, 3, 7)};
  const auto bytes = sizes_of(list);
  const at::Tensor other = at::zeros({1}, at::kFloat);
  cd::ListBuffer buf({}, list, bytes, other, other.data_ptr(), 4);
  EXPECT_TRUE(buf.in_place());
  EXPECT_EQ(buf.displs(), (std::vector<std::size_t>{0, 12, 12}));
  const std::vector<at::Tensor> apart = {at::ones({3}, at::kFloat), at::empty({0}, at::kFloat),
                                         at::full({2}, 7.0F, at::kFloat)};
  const auto apart_bytes = sizes_of(apart);
  cd::ListBuffer staged({}, apart, apart_bytes, other, other.data_ptr(), 4);
  ASSERT_FALSE(staged.in_place());
  staged.pack();
  const auto* f = static_cast<const float*>(staged.data());
  EXPECT_EQ(f[2], 1.0F);
  EXPECT_EQ(f[3], 7.0F);
}

TEST(ListBuffer, AFinishedCallsStagingIsReusedByTheNextAndAFailedOnesIsNot) {
  constexpr std::size_t kBig = 2 << 20;  // above what the earlier tests left kept
  const std::vector<at::Tensor> list = {at::ones({1 << 20}, at::kByte),
                                        at::ones({1 << 20}, at::kByte)};
  const auto bytes = sizes_of(list);
  const at::Tensor other = at::zeros({1}, at::kFloat);
  ASSERT_LT(cd::kept_staging_bytes(), kBig);
  void* first = nullptr;
  {
    cd::ListBuffer a({}, list, bytes, other, other.data_ptr(), 4);
    cd::ListBuffer b({}, list, bytes, other, other.data_ptr(), 4);  // at the same time: its own
    EXPECT_NE(a.data(), b.data());
    first = a.data();
    a.pack();  // above 256 KiB per element: copy_
    EXPECT_EQ(static_cast<const unsigned char*>(a.data())[kBig - 1], 1);
    a.done();  // b's call failed
  }
  EXPECT_GE(cd::kept_staging_bytes(), kBig);
  EXPECT_LT(cd::kept_staging_bytes(), 2 * kBig) << "the failed call's buffer was kept";
  {
    cd::ListBuffer c({}, list, bytes, other, other.data_ptr(), 4);
    EXPECT_EQ(c.data(), first);
    EXPECT_LT(cd::kept_staging_bytes(), kBig);  // taken
    // c's call fails too
  }
  EXPECT_LT(cd::kept_staging_bytes(), kBig);
  {
    cd::ListBuffer d({}, list, bytes, other, other.data_ptr(), 4);
    d.unpack();  // as done()
  }
  EXPECT_GE(cd::kept_staging_bytes(), kBig);
}

// The kept staging is the process's until its last group goes (destroy_process_group()): then
// it is freed. Before, up to 128 MiB stayed for the life of the process.
TEST(ListBuffer, TheLastGroupToGoFreesTheKeptStaging) {
  constexpr std::size_t kBig = 2 << 20;
  const std::vector<at::Tensor> list = {at::ones({1 << 20}, at::kByte),
                                        at::ones({1 << 20}, at::kByte)};
  const auto bytes = sizes_of(list);
  const at::Tensor other = at::zeros({1}, at::kFloat);
  auto first = std::make_unique<cd::KeptStagingUser>();
  {
    cd::KeptStagingUser second;
    {
      cd::ListBuffer a({}, list, bytes, other, other.data_ptr(), 4);
      a.done();
    }
    EXPECT_GE(cd::kept_staging_bytes(), kBig);
  }
  EXPECT_GE(cd::kept_staging_bytes(), kBig) << "freed while a group was left";
  first.reset();
  EXPECT_EQ(cd::kept_staging_bytes(), 0U);
}
