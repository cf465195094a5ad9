// Unit tests without a network (TcpStore uses loopback only): the tag layout and the stores.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>
#include <thread>

#include "commux/communicator.hpp"
#include "commux/transports.hpp"
#include "harness.hpp"

using namespace commux;
using namespace commux::tag_layout;

TEST(Tag, FieldsRoundTrip) {
  TagFields f;
  f.sender = kMaxRanks - 1;
  f.group = kMaxGroups - 1;
  f.kind = TagKind::kInternal;
  f.continuation = true;
  f.packing = Packing::kIov;
  f.user = 0xFFFFFFFFu;
  const TagFields g = parse_tag(make_tag(f));
  EXPECT_EQ(g.sender, f.sender);
  EXPECT_EQ(g.group, f.group);
  EXPECT_EQ(g.kind, f.kind);
  EXPECT_EQ(g.continuation, f.continuation);
  EXPECT_EQ(g.packing, f.packing);
  EXPECT_EQ(g.user, f.user);
  EXPECT_EQ(make_tag(f).bits & kReservedBit, 0u);
}

TEST(Tag, EachFieldHasItsOwnBits) {
  EXPECT_EQ(make_tag(TagFields{}).bits, 0u);
  TagFields f;
  f.user = 0xABCD1234u;
  EXPECT_EQ(make_tag(f).bits, 0xABCD1234u);
  f = TagFields{};
  f.sender = 1;
  EXPECT_EQ(make_tag(f).bits, std::uint64_t{1} << 44);
  f = TagFields{};
  f.group = 1;
  EXPECT_EQ(make_tag(f).bits, std::uint64_t{1} << 36);
  f = TagFields{};
  f.kind = TagKind::kInternal;
  EXPECT_EQ(make_tag(f).bits, std::uint64_t{1} << 35);
  f = TagFields{};
  f.continuation = true;
  EXPECT_EQ(make_tag(f).bits, std::uint64_t{1} << 34);
  f = TagFields{};
  f.packing = Packing::kIov;
  EXPECT_EQ(make_tag(f).bits, std::uint64_t{1} << 33);
  // The masks tile the 64 bits with the reserved bit.
  EXPECT_EQ(kUserMask | kReservedBit | kIovBit | kContinuationBit | kInternalBit | kGroupMask | kRankMask,
            ~std::uint64_t{0});
}

TEST(Tag, OutOfRangeFieldsAreRejected) {
  TagFields f;
  f.sender = kMaxRanks;
  EXPECT_THROW(make_tag(f), Error);
  f.sender = -1;
  EXPECT_THROW(make_tag(f), Error);
  f = TagFields{};
  f.group = kMaxGroups;
  EXPECT_THROW(make_tag(f), Error);
}

TEST(Tag, UserTagPolicy) {
  EXPECT_EQ(check_user_tag(0, "x"), 0u);
  EXPECT_EQ(check_user_tag(kMaxUserTag, "x"), 0xFFFFFFFFu);
  try {
    check_user_tag(-3, "isend");
    FAIL() << "negative tag accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("commux isend: tag -3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(check_user_tag(kMaxUserTag + 1, "irecv"), Error);
}

TEST(Tag, ReceiveMatching) {
  auto matches = [](RecvMatch m, TagValue t) { return (t.bits & m.mask.bits) == (m.tag.bits & m.mask.bits); };
  TagFields s;
  s.sender = 5;
  s.group = 2;
  s.user = 42;
  const TagValue from5 = make_tag(s);
  EXPECT_TRUE(matches(recv_match(5, 2, TagKind::kUser, false, 42), from5));
  EXPECT_FALSE(matches(recv_match(4, 2, TagKind::kUser, false, 42), from5));   // other sender
  EXPECT_FALSE(matches(recv_match(5, 3, TagKind::kUser, false, 42), from5));   // other group
  EXPECT_FALSE(matches(recv_match(5, 2, TagKind::kUser, false, 43), from5));   // other tag
  EXPECT_FALSE(matches(recv_match(5, 2, TagKind::kInternal, false, 42), from5));  // kind
  EXPECT_TRUE(matches(recv_match(-1, 2, TagKind::kUser, false, 42), from5));   // any source
  TagFields cont = s;
  cont.continuation = true;
  EXPECT_FALSE(matches(recv_match(-1, 2, TagKind::kUser, false, 42), make_tag(cont)));
  EXPECT_TRUE(matches(recv_match(5, 2, TagKind::kUser, true, 42), make_tag(cont)));
  TagFields packed = s;
  packed.packing = Packing::kIov;  // matched regardless, compared after completion
  EXPECT_TRUE(matches(recv_match(5, 2, TagKind::kUser, false, 42), make_tag(packed)));
  EXPECT_EQ(parse_tag(from5).sender, 5);
}

// Shared by both stores: get() waits for a key another party sets later, and a key that never
// appears is a kTimeout naming the key.
void check_get_waits_then_times_out(Store& reader, Store& writer) {
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    writer.set("late", {7});
  });
  EXPECT_EQ(reader.get("late", std::chrono::seconds(5)), (std::vector<std::uint8_t>{7}));
  late.join();
  try {
    reader.get("never", std::chrono::milliseconds(30));
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout);
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
  }
}

class FileStoreTest : public ::testing::Test {
 protected:
  commux::test::TempDir tmp_{"commux-store"};
  const std::string dir_ = tmp_.path();
};

TEST_F(FileStoreTest, SetGetCheck) {
  FileStore s(dir_ + "/nested/dir");
  EXPECT_FALSE(s.check("a/b"));
  s.set("a/b", {1, 2, 3});
  EXPECT_TRUE(s.check("a/b"));
  EXPECT_EQ(s.get("a/b", std::chrono::milliseconds(10)), (std::vector<std::uint8_t>{1, 2, 3}));
  s.set("a/b", {});
  EXPECT_TRUE(s.get("a/b", std::chrono::milliseconds(10)).empty());
  s.set("a%2Fb", {9});  // must not collide with "a/b"
  EXPECT_TRUE(s.get("a/b", std::chrono::milliseconds(10)).empty());
}

TEST_F(FileStoreTest, GetWaitsThenTimesOut) {
  FileStore reader(dir_), writer(dir_);
  check_get_waits_then_times_out(reader, writer);
}

TEST(TcpStoreTest, ServerAndClientSeeEachOther) {
  const int port = 30000 + static_cast<int>(::getpid() % 20000);
  TcpStore server("127.0.0.1", port, /*is_server=*/true, std::chrono::seconds(5));
  TcpStore client("127.0.0.1", port, /*is_server=*/false, std::chrono::seconds(5));
  EXPECT_FALSE(client.check("k"));
  server.set("k", {4, 5});
  EXPECT_TRUE(client.check("k"));
  EXPECT_EQ(client.get("k", std::chrono::milliseconds(10)), (std::vector<std::uint8_t>{4, 5}));
  client.set("empty", {});
  EXPECT_TRUE(server.get("empty", std::chrono::milliseconds(10)).empty());
  check_get_waits_then_times_out(client, server);
}

TEST(TcpStoreTest, NoServerIsATimeoutNamingTheAddress) {
  try {
    TcpStore client("127.0.0.1", 1, /*is_server=*/false, std::chrono::milliseconds(100));
    FAIL() << "connected to port 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout);
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:1"), std::string::npos) << e.what();
  }
}

// ---- transport choice by accelerator (inputs injected: no GPU needed) --------------------------

namespace {

using commux::Accelerator;
using commux::choose_transports;

const std::vector<std::string> kCudaUcx = {"self", "tcp", "sysv", "posix", "cma", "cuda_copy",
                                           "cuda_ipc", "gdr_copy"};
const std::vector<std::string> kCudaNoIpc = {"self", "tcp", "posix", "cuda_copy"};
const std::vector<std::string> kRocmUcx = {"self", "tcp", "posix", "rocm_cpy", "rocm_ipc", "rocm_gdr"};
const std::vector<std::string> kZeUcx = {"self", "tcp", "posix", "ze_copy", "ze_ipc"};
const std::vector<std::string> kHostUcx = {"self", "tcp", "sysv", "posix", "cma"};

bool any_warning_has(const commux::TransportChoice& c, const std::string& text) {
  for (const auto& w : c.warnings) {
    if (w.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST(Transports, CudaTakesCopyPlusIpcAndGdrWhenPresent) {
  auto c = choose_transports(Accelerator::kCuda, kCudaUcx, nullptr);
  EXPECT_EQ(c.transports, (std::vector<std::string>{"cuda_copy", "cuda_ipc", "gdr_copy"}));
  EXPECT_TRUE(c.copy_available);
  EXPECT_TRUE(c.copy_allowed);
  EXPECT_TRUE(c.warnings.empty());
  c = choose_transports(Accelerator::kCuda, kCudaNoIpc, nullptr);
  EXPECT_EQ(c.transports, (std::vector<std::string>{"cuda_copy"}));  // never an absent one
  EXPECT_TRUE(c.warnings.empty());
}

TEST(Transports, RocmTakesRocmCopyAndIpcNeverCuda) {
  const auto c = choose_transports(Accelerator::kRocm, kRocmUcx, nullptr);
  EXPECT_EQ(c.transports, (std::vector<std::string>{"rocm_copy", "rocm_ipc"}));
  EXPECT_EQ(c.copy_transport, "rocm_copy");
  EXPECT_TRUE(c.warnings.empty());
  // A ROCm build on a UCX with CUDA transports only: nothing CUDA is named, and a warning says
  // rocm_copy is missing.
  const auto d = choose_transports(Accelerator::kRocm, kCudaUcx, nullptr);
  EXPECT_TRUE(d.transports.empty());
  EXPECT_FALSE(d.copy_available);
  EXPECT_TRUE(any_warning_has(d, "no rocm_copy"));
}

TEST(Transports, XpuTakesZeCopy) {
  const auto c = choose_transports(Accelerator::kXpu, kZeUcx, nullptr);
  ASSERT_FALSE(c.transports.empty());
  EXPECT_EQ(c.transports.front(), "ze_copy");
  EXPECT_TRUE(c.warnings.empty());
  // The bug this guards against: an Intel GPU must not be handed cuda_copy.
  const auto d = choose_transports(Accelerator::kXpu, kCudaUcx, nullptr);
  EXPECT_TRUE(d.transports.empty());
  EXPECT_TRUE(any_warning_has(d, "no ze_copy"));
}

TEST(Transports, UnknownAcceleratorGetsNoCopyTransportAndAWarning) {
  const auto c = choose_transports(Accelerator::kUnknown, kCudaUcx, nullptr, "mps");
  EXPECT_TRUE(c.transports.empty());
  EXPECT_TRUE(c.copy_transport.empty());
  EXPECT_TRUE(any_warning_has(c, "'mps'"));
}

TEST(Transports, CpuOnlyNeedsNothing) {
  const auto c = choose_transports(Accelerator::kNone, kHostUcx, "tcp");
  EXPECT_TRUE(c.transports.empty());
  EXPECT_TRUE(c.warnings.empty());
}

TEST(Transports, CudaOnAHostOnlyUcxWarnsWithTheFix) {
  const auto c = choose_transports(Accelerator::kCuda, kHostUcx, nullptr);
  EXPECT_TRUE(c.transports.empty());
  EXPECT_FALSE(c.copy_available);
  EXPECT_TRUE(any_warning_has(c, "no cuda_copy"));
  EXPECT_TRUE(any_warning_has(c, "libucx-cu13"));
}

TEST(Transports, UserAllowListIsCheckedNeverChanged) {
  // Lacks the copy transport: a warning naming it; the choice still reports what UCX has.
  auto c = choose_transports(Accelerator::kCuda, kCudaUcx, "tcp,sm");
  EXPECT_FALSE(c.copy_allowed);
  EXPECT_TRUE(any_warning_has(c, "UCX_TLS=tcp,sm does not include cuda_copy"));
  EXPECT_TRUE(any_warning_has(c, "leaves your UCX_TLS"));
  // Names it, through the transport, an alias, a qualifier, or "all": no warning.
  for (const char* tls : {"tcp,cuda_copy", "sm,cuda", "cuda_copy:aux,tcp", "all"}) {
    c = choose_transports(Accelerator::kCuda, kCudaUcx, tls);
    EXPECT_TRUE(c.copy_allowed) << tls;
    EXPECT_TRUE(c.warnings.empty()) << tls;
  }
  c = choose_transports(Accelerator::kRocm, kRocmUcx, "tcp,rocm");
  EXPECT_TRUE(c.copy_allowed);
}

TEST(Transports, DenyListIsLeftAloneAndOnlyWarnedAboutWhenItDeniesTheCopy) {
  auto c = choose_transports(Accelerator::kCuda, kCudaUcx, "^cma");
  EXPECT_TRUE(c.copy_allowed);
  EXPECT_TRUE(c.warnings.empty());
  // "^all" would deny everything; "all" in a deny list is not an allow.
  c = choose_transports(Accelerator::kCuda, kCudaUcx, "^cuda_copy,cma");
  EXPECT_FALSE(c.copy_allowed);
  EXPECT_TRUE(any_warning_has(c, "excludes cuda_copy"));
  c = choose_transports(Accelerator::kCuda, kCudaUcx, "^cuda");
  EXPECT_FALSE(c.copy_allowed);
}

TEST(Transports, ProbeListsWhatThisUcxHasWhateverUcxTlsSays) {
  const auto all = commux::ucx_available_transports();
  EXPECT_NE(std::find(all.begin(), all.end(), "self"), all.end());
  ::setenv("UCX_TLS", "tcp", 1);
  const auto again = commux::ucx_available_transports();
  ::unsetenv("UCX_TLS");
  EXPECT_EQ(all, again);
}
