// Unit tests without a network (TcpStore uses loopback only): the tag layout and the stores.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <thread>

#include "commux/communicator.hpp"
#include "commux/transports.hpp"
#include "backoff.hpp"
#include "log.hpp"
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
  EXPECT_EQ(make_tag(f).bits & kNoticeBit, 0u);
  f.kind = TagKind::kNotice;
  EXPECT_EQ(parse_tag(make_tag(f)).kind, TagKind::kNotice);
  EXPECT_EQ(make_tag(f).bits & (kNoticeBit | kInternalBit), kNoticeBit | kInternalBit);
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
  // The masks tile the 64 bits with the notice bit.
  EXPECT_EQ(kUserMask | kNoticeBit | kIovBit | kContinuationBit | kInternalBit | kGroupMask |
                kRankMask,
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
  auto matches = [](RecvMatch m, TagValue t) {
    return (t.bits & m.mask.bits) == (m.tag.bits & m.mask.bits);
  };
  TagFields s;
  s.sender = 5;
  s.group = 2;
  s.user = 42;
  const TagValue from5 = make_tag(s);
  EXPECT_TRUE(matches(recv_match(5, 2, TagKind::kUser, false, 42), from5));
  EXPECT_FALSE(matches(recv_match(4, 2, TagKind::kUser, false, 42), from5));      // other sender
  EXPECT_FALSE(matches(recv_match(5, 3, TagKind::kUser, false, 42), from5));      // other group
  EXPECT_FALSE(matches(recv_match(5, 2, TagKind::kUser, false, 43), from5));      // other tag
  EXPECT_FALSE(matches(recv_match(5, 2, TagKind::kInternal, false, 42), from5));  // kind
  EXPECT_TRUE(matches(recv_match(-1, 2, TagKind::kUser, false, 42), from5));      // any source
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
  // (A port derived from the pid collided with ports in use: "Address already in use".)
  const int port = test::free_port();
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

const std::vector<std::string> kCudaUcx = {"self", "tcp",       "sysv",     "posix",
                                           "cma",  "cuda_copy", "cuda_ipc", "gdr_copy"};
const std::vector<std::string> kCudaNoIpc = {"self", "tcp", "posix", "cuda_copy"};
const std::vector<std::string> kRocmUcx = {"self",     "tcp",      "posix",
                                           "rocm_cpy", "rocm_ipc", "rocm_gdr"};
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

// ---- settings (commux/settings.hpp): the table and its one parser ---------------------------------

namespace {

// A fake environment for Settings::parse.
Settings parse_env(const std::vector<std::pair<std::string, std::string>>& env) {
  return Settings::parse([&env](const char* name) -> const char* {
    for (const auto& kv : env) {
      if (kv.first == name) return kv.second.c_str();
    }
    return nullptr;
  });
}

std::string parse_error(const std::vector<std::pair<std::string, std::string>>& env) {
  try {
    parse_env(env);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error for " << env.front().first << "='" << env.front().second << "'";
  return {};
}

}  // namespace

TEST(Settings, DefaultsAreTheTableDefaults) {
  const Settings s = parse_env({});
  const Options o;  // the defaults Options documents
  EXPECT_FALSE(s.coalesce);
  EXPECT_FALSE(s.group);
  EXPECT_EQ(s.spin, o.spin);
  EXPECT_EQ(s.timeout, o.timeout);
  EXPECT_EQ(s.shutdown_timeout, o.shutdown_timeout);
  EXPECT_EQ(s.wakeup, Settings::Wakeup::kAuto);
  EXPECT_TRUE(s.ucx_defaults);
  EXPECT_FALSE(s.aten_reduce);
  EXPECT_FALSE(s.device_cuda);
  EXPECT_EQ(s.test_timeout_s, 120);
  ASSERT_EQ(s.values.size(), settings_table().size());
  for (std::size_t i = 0; i < s.values.size(); ++i) {
    EXPECT_EQ(s.values[i].setting, &settings_table()[i]);
    EXPECT_FALSE(s.values[i].from_env) << s.values[i].setting->name;
  }
  EXPECT_EQ(s.text("COMMUX_ALGO_ALLREDUCE"), "auto");
  EXPECT_EQ(s.text("COMMUX_CUDART"), "");
}

TEST(Settings, TableNamesAreUniqueAndDocumented) {
  std::vector<std::string> names;
  for (const Setting& s : settings_table()) {
    names.emplace_back(s.name);
    EXPECT_TRUE(names.back().rfind("COMMUX_", 0) == 0 || names.back() == "UCXPG_DEVICE") << s.name;
    EXPECT_NE(std::string(s.type), "") << s.name;
    EXPECT_NE(std::string(s.default_value), "") << s.name;
    EXPECT_NE(std::string(s.meaning), "") << s.name;
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end());
}

TEST(Settings, ParsesValidValues) {
  const Settings s = parse_env({{"COMMUX_COALESCE", "1"},
                                {"COMMUX_GROUP", "on"},
                                {"COMMUX_SPIN_US", "0"},
                                {"COMMUX_TIMEOUT_MS", "2500"},
                                {"COMMUX_SHUTDOWN_TIMEOUT_MS", "10"},
                                {"COMMUX_WAKEUP", "off"},
                                {"COMMUX_UCX_DEFAULTS", "0"},
                                {"COMMUX_ATEN_REDUCE", "true"},
                                {"COMMUX_ALGO_ALLREDUCE", "ring"},
                                {"UCXPG_DEVICE", "cuda"},
                                {"COMMUX_BENCH_V", "16"},
                                {"COMMUX_CUDART", "/opt/libcudart.so.13"},
                                {"COMMUX_TEST_TIMEOUT_S", ""}});  // empty: unset
  EXPECT_TRUE(s.coalesce);
  EXPECT_TRUE(s.group);
  EXPECT_EQ(s.spin.count(), 0);
  EXPECT_EQ(s.timeout.count(), 2500);
  EXPECT_EQ(s.shutdown_timeout.count(), 10);
  EXPECT_EQ(s.wakeup, Settings::Wakeup::kOff);
  EXPECT_FALSE(s.ucx_defaults);
  EXPECT_TRUE(s.aten_reduce);
  EXPECT_TRUE(s.device_cuda);
  EXPECT_EQ(s.bench_v, 16);
  EXPECT_EQ(s.cudart, "/opt/libcudart.so.13");
  EXPECT_EQ(s.test_timeout_s, 120);
  EXPECT_EQ(s.text("COMMUX_ALGO_ALLREDUCE"), "ring");
  EXPECT_EQ(s.text("COMMUX_WAKEUP"), "off");
  const std::vector<std::string> given = {"COMMUX_COALESCE",
                                          "COMMUX_GROUP",
                                          "COMMUX_SPIN_US",
                                          "COMMUX_TIMEOUT_MS",
                                          "COMMUX_SHUTDOWN_TIMEOUT_MS",
                                          "COMMUX_WAKEUP",
                                          "COMMUX_UCX_DEFAULTS",
                                          "COMMUX_ATEN_REDUCE",
                                          "COMMUX_ALGO_ALLREDUCE",
                                          "UCXPG_DEVICE",
                                          "COMMUX_BENCH_V",
                                          "COMMUX_CUDART"};
  for (const auto& v : s.values) {
    const bool set = std::find(given.begin(), given.end(), v.setting->name) != given.end();
    EXPECT_EQ(v.from_env, set) << v.setting->name;
  }
  EXPECT_EQ(parse_env({{"COMMUX_WAKEUP", "1"}}).wakeup, Settings::Wakeup::kOn);
  EXPECT_EQ(parse_env({{"COMMUX_WAKEUP", "auto"}}).wakeup, Settings::Wakeup::kAuto);
  EXPECT_EQ(parse_env({}).yield, Settings::Yield::kAuto);
  EXPECT_EQ(parse_env({{"COMMUX_YIELD", "on"}}).yield, Settings::Yield::kOn);
  EXPECT_EQ(parse_env({{"COMMUX_YIELD", "0"}}).yield, Settings::Yield::kOff);
}

TEST(Settings, InvalidValuesNameTheVariableAndTheValue) {
  EXPECT_EQ(parse_error({{"COMMUX_WAKEUP", "sometimes"}}),
            "commux settings: COMMUX_WAKEUP='sometimes' is not auto, on or off");
  EXPECT_EQ(parse_error({{"COMMUX_YIELD", "often"}}),
            "commux settings: COMMUX_YIELD='often' is not auto, on or off");
  EXPECT_NE(parse_error({{"COMMUX_SPIN_US", "-5"}})
                .find("COMMUX_SPIN_US='-5' is not a non-negative integer"),
            std::string::npos);
  EXPECT_NE(parse_error({{"COMMUX_TIMEOUT_MS", "10s"}}).find("COMMUX_TIMEOUT_MS='10s'"),
            std::string::npos);
  EXPECT_NE(
      parse_error({{"COMMUX_TIMEOUT_MS", "99999999999999999999999"}}).find("non-negative integer"),
      std::string::npos);
  EXPECT_NE(parse_error({{"COMMUX_GROUP", "2"}}).find("COMMUX_GROUP='2' is not a boolean"),
            std::string::npos);
  EXPECT_NE(parse_error({{"UCXPG_DEVICE", "gpu"}})
                .find("UCXPG_DEVICE='gpu' is not a device (cpu or cuda)"),
            std::string::npos);
  try {
    parse_env({}).text("COMMUX_NOPE");
    ADD_FAILURE() << "no error for an unknown setting";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'COMMUX_NOPE' is not a commux setting"),
              std::string::npos);
  }
}

// Options::from_env() reads the environment at each call (each communicator / process group).
TEST(Settings, OptionsFromEnvReadsTheEnvironmentNow) {
  ::setenv("COMMUX_SPIN_US", "7", 1);
  ::setenv("COMMUX_GROUP", "1", 1);
  EXPECT_EQ(Options::from_env().spin.count(), 7);
  EXPECT_TRUE(Options::from_env().defer_in_window);
  ::setenv("COMMUX_WAKEUP", "x", 1);
  try {
    Options::from_env();
    ADD_FAILURE() << "no error for COMMUX_WAKEUP=x";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("COMMUX_WAKEUP='x' is not auto, on or off"),
              std::string::npos);
  }
  ::unsetenv("COMMUX_WAKEUP");
  ::unsetenv("COMMUX_GROUP");
  ::setenv("COMMUX_SPIN_US", "100", 1);  // as ctest sets it
  EXPECT_FALSE(Options::from_env().defer_in_window);
}

// RuntimeInfo::supports reads UCX's own names for the memory types (what RuntimeInfo lists), the
// check core makes before it posts and the torch adapter makes before it accepts a tensor.
TEST(RuntimeInfoTest, SupportsReadsUcxMemoryTypeNames) {
  RuntimeInfo host_only;
  host_only.memory_types = {"host"};
  EXPECT_TRUE(host_only.supports(MemoryType::kHost));
  EXPECT_TRUE(host_only.supports(MemoryType::kUnknown));  // UCX detects such a buffer itself
  EXPECT_FALSE(host_only.supports(MemoryType::kCuda));
  EXPECT_FALSE(host_only.supports(MemoryType::kRocm));
  EXPECT_FALSE(host_only.supports(MemoryType::kZe));

  RuntimeInfo cuda;
  cuda.memory_types = {"host", "cuda", "cuda-managed"};
  EXPECT_TRUE(cuda.supports(MemoryType::kCuda));
  EXPECT_TRUE(cuda.supports(MemoryType::kCudaManaged));
  EXPECT_FALSE(cuda.supports(MemoryType::kRocm));

  RuntimeInfo rocm;
  rocm.memory_types = {"host", "rocm"};
  EXPECT_TRUE(rocm.supports(MemoryType::kRocm));
  EXPECT_FALSE(rocm.supports(MemoryType::kCuda));

  RuntimeInfo none;  // even an empty list: host memory is always carried
  EXPECT_TRUE(none.supports(MemoryType::kHost));
}

// ---- the debug log (src/core/log.hpp) ------------------------------------------------------------

TEST(Settings, DebugLevelParsesAnyCaseAndRejectsOthers) {
  EXPECT_EQ(parse_env({}).debug, 0);
  EXPECT_EQ(parse_env({{"COMMUX_DEBUG", "warn"}}).debug, 1);
  EXPECT_EQ(parse_env({{"COMMUX_DEBUG", "INFO"}}).debug, 2);
  EXPECT_EQ(parse_env({{"COMMUX_DEBUG", "Trace"}}).debug, 3);
  EXPECT_EQ(parse_env({{"COMMUX_DEBUG", "off"}}).debug, 0);
  EXPECT_EQ(parse_env({{"COMMUX_DEBUG_FILE", "/tmp/x.%p"}}).debug_file, "/tmp/x.%p");
  EXPECT_EQ(
      parse_error({{"COMMUX_DEBUG", "VERBOSE"}}),
      "commux settings: COMMUX_DEBUG='VERBOSE' is not a log level (off, WARN, INFO or TRACE)");
}

namespace {

std::string read_file(const std::string& path) {
  std::string out;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

int g_evaluated = 0;
std::string counted() {
  ++g_evaluated;
  return "x";
}

}  // namespace

TEST(Log, LinesCarryHostPidRankAndLevelAndRespectTheLevel) {
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const std::string path = "/tmp/commux-log-test-%p.log";
  const std::string real = "/tmp/commux-log-test-" + std::to_string(::getpid()) + ".log";
  std::remove(real.c_str());
  log::reset_for_testing(log::Level::kInfo, path);
  COMMUX_LOG(kInfo, 3, "peer ", 1, ": lanes ", "tcp/lo");
  COMMUX_LOG(kWarn, -1, "no rank yet");
  g_evaluated = 0;
  COMMUX_LOG(kTrace, 3, "never ", counted());
  EXPECT_EQ(g_evaluated, 0) << "a disabled level must not build its message";
  const std::string prefix = std::string(host) + ":" + std::to_string(::getpid());
  EXPECT_EQ(read_file(real), prefix + " [rank 3] commux INFO peer 1: lanes tcp/lo\n" + prefix +
                                 " [rank -] commux WARN no rank yet\n");
  log::reset_for_testing(log::Level::kOff, "");
  COMMUX_LOG(kWarn, 0, "off ", counted());
  EXPECT_EQ(g_evaluated, 0);
  EXPECT_FALSE(log::enabled(log::Level::kWarn));
  std::remove(real.c_str());
}

// A poll that backs off must notice what it waits for soon after it happens: each nap is at most
// about a quarter of the time already waited (plus the first nap), never more than the cap, and
// a long wait settles at the cap. (The fences' earlier doubling naps were up to the whole time
// waited: a device stream that finished just after a poll was seen up to 1 ms late.)
TEST(PollBackoff, NapsStayAQuarterOfTheWaitAndSettleAtTheCap) {
  using std::chrono::microseconds;
  for (const auto& [first, cap] : {std::pair{microseconds(20), commux::detail::kEventPollCap},
                                   std::pair{microseconds(5), microseconds(2000)},
                                   std::pair{microseconds(1), microseconds(1)}}) {
    commux::detail::PollBackoff b(first, cap, cap);  // no long cap
    microseconds waited{0}, last{0};
    for (int k = 0; k < 200; ++k) {
      const microseconds nap = b.next();
      SCOPED_TRACE("nap " + std::to_string(k) + " of " + std::to_string(nap.count()) +
                   " us after " + std::to_string(waited.count()) + " us");
      EXPECT_GE(nap, last);
      EXPECT_LE(nap, cap);
      EXPECT_LE(nap.count(), first.count() + (waited.count() + 3) / 3);
      waited += nap;
      last = nap;
    }
    EXPECT_EQ(last, cap);
    b.reset();
    EXPECT_EQ(b.next(), first);
  }
}

// A long wait does not keep polling at the short cap: the naps stay within it while the wait is
// under kLongWaitRatio times it, then within 1/kLongWaitRatio of the wait (and a quarter more),
// and settle at the long cap. Without it a post held behind a kernel for seconds was polled 4000
// times a second (Failures.HeldPostWaitedForSecondsUsesLittleCpu used 7% of a core).
TEST(PollBackoff, ALongWaitSettlesAtTheLongCap) {
  using std::chrono::microseconds;
  namespace d = commux::detail;
  d::PollBackoff b(microseconds(20), d::kEventPollCap, d::kEventPollLongCap);
  microseconds waited{0}, last{0};
  for (int k = 0; k < 20000 && waited < std::chrono::seconds(2); ++k) {
    const microseconds nap = b.next();
    SCOPED_TRACE("nap " + std::to_string(k) + " of " + std::to_string(nap.count()) + " us after " +
                 std::to_string(waited.count()) + " us");
    EXPECT_GE(nap, last);
    EXPECT_LE(nap, d::kEventPollLongCap);
    if (waited < d::kEventPollCap * d::kLongWaitRatio) {
      EXPECT_LE(nap, d::kEventPollCap);
    }
    EXPECT_LE(nap,
              std::max(d::kEventPollCap, waited / d::kLongWaitRatio * 5 / 4 + microseconds(2)));
    waited += nap;
    last = nap;
  }
  EXPECT_EQ(last, d::kEventPollLongCap);
  b.reset();
  EXPECT_EQ(b.next(), microseconds(20));
  // A wait that starts over keeps to the short cap again for its first 16 ms.
  microseconds again = b.next() + microseconds(20);
  while (again < d::kEventPollCap * d::kLongWaitRatio) {
    const microseconds nap = b.next();
    EXPECT_LE(nap, d::kEventPollCap) << "after " << again.count() << " us";
    again += nap;
  }
  // A long cap under the short one is the short one.
  EXPECT_EQ(d::wait_cap(std::chrono::seconds(10), microseconds(500), microseconds(100)),
            microseconds(500));
}

// A yield that comes back slowly (a foreign task ran a whole slice on this CPU) shuts the gate, so
// waiters stop handing out slices; quick ones leave it open, and it reopens after.
// Without it, an 8 B allreduce between 2 ranks beside 2 busy loops took 2 ms a call.
TEST(YieldGate, ASlowYieldStopsYieldingForAWhile) {
  using commux::detail::YieldGate;
  using std::chrono::microseconds;
  YieldGate g;
  const YieldGate::Clock::time_point t = YieldGate::Clock::now();
  EXPECT_TRUE(g.open(t));
  EXPECT_TRUE(g.record(t, t + microseconds(3)));  // the peer answered: go on yielding
  EXPECT_TRUE(g.record(t, t + YieldGate::kSlow - microseconds(1)));
  EXPECT_TRUE(g.open(t + microseconds(300)));
  const auto back = t + microseconds(1500);
  EXPECT_FALSE(g.record(t, back));  // 1.5 ms: a slice went to someone else
  EXPECT_FALSE(g.open(back));
  EXPECT_FALSE(g.open(back + YieldGate::kFirstOff - microseconds(1)));
  EXPECT_TRUE(g.open(back + YieldGate::kFirstOff));  // probes again
  const auto probe = back + YieldGate::kFirstOff;
  EXPECT_TRUE(g.record(probe, probe + microseconds(2)));
  EXPECT_TRUE(g.open(probe + microseconds(2)));
}

// One slow yield shuts the gate briefly: right after init some start-up thread often runs a
// slice, and a 100 ms period then cost every 8 B exchange of those 100 ms a 250 us spin (the
// ranks' main threads, queued on one CPU, could not hand it to each other). Slow probes that keep
// coming (a hog that stays) double the period up to kMaxOff; after kForget without one it starts
// over. A slow yield that began while the gate was open but returns after another thread shut it
// does not extend that thread's period.
TEST(YieldGate, TheGateStaysShutLongerOnlyWhileSlowYieldsKeepComing) {
  using commux::detail::YieldGate;
  using Clock = YieldGate::Clock;
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  YieldGate g;
  Clock::time_point now = Clock::now();
  const auto slice = microseconds(1500);
  // A hog: every probe, as soon as the gate reopens, hands it a slice.
  std::vector<Clock::duration> periods;
  for (int i = 0; i < 10; ++i) {
    ASSERT_FALSE(g.record(now, now + slice));
    now += slice;
    Clock::time_point reopen = now;
    // (Bounded: a gate that never reopened would otherwise spin this loop for good.)
    for (int step = 0; step < 10000 && !g.open(reopen); ++step) reopen += microseconds(100);
    ASSERT_TRUE(g.open(reopen)) << "still shut " << (reopen - now).count() << " ticks after probe "
                                << i;
    periods.push_back(reopen - now);
    now = reopen;
  }
  EXPECT_LT(periods[0], YieldGate::kFirstOff + microseconds(100));
  for (std::size_t i = 1; i < periods.size(); ++i) {
    EXPECT_GE(periods[i], periods[i - 1]) << i;
    EXPECT_LE(periods[i], YieldGate::kMaxOff + microseconds(100)) << i;
  }
  EXPECT_GE(periods.back(), YieldGate::kMaxOff) << "a hog that stays is probed once per kMaxOff";
  // Quiet for kForget: the next slow yield shuts the gate for kFirstOff again.
  now += YieldGate::kForget;
  EXPECT_TRUE(g.open(now));
  EXPECT_FALSE(g.record(now, now + slice));
  now += slice;
  EXPECT_FALSE(g.open(now + YieldGate::kFirstOff - microseconds(1)));
  EXPECT_TRUE(g.open(now + YieldGate::kFirstOff));
  // Two threads' yields of one slice: the second to return leaves the first's period as it is.
  now += milliseconds(1);  // reopened, and a slow probe comes at once: 2 * kFirstOff
  const auto t0 = now;
  EXPECT_FALSE(g.record(t0, t0 + slice));
  EXPECT_FALSE(g.record(t0, t0 + slice + microseconds(50)));
  EXPECT_TRUE(g.open(t0 + slice + 2 * YieldGate::kFirstOff));
}

// A large post that lands between the progress thread's look at what is in flight and its
// arming for a long sleep found the flag down and signalled nothing; the sleep then ran to its
// end (up to 10 ms) with the transfer unmoved. Now arm() sees the post and says so.
TEST(LongSleepFlag, APostBetweenTheLookAndTheArmingIsNotMissed) {
  commux::detail::LongSleepFlag f;
  const std::uint64_t seen = f.posts();  // the look
  EXPECT_FALSE(f.posted());              // the post: nothing armed, so it signals nothing...
  EXPECT_TRUE(f.arm(seen));              // ...and the sleep must act on it without sleeping
  f.disarm();
  // A post after the arming takes the flag and signals; arm() had nothing to act on.
  const std::uint64_t seen2 = f.posts();
  EXPECT_FALSE(f.arm(seen2));
  EXPECT_TRUE(f.posted());
  EXPECT_FALSE(f.posted());  // once per sleep
  f.disarm();
  // No post: nothing acts.
  EXPECT_FALSE(f.arm(f.posts()));
  f.disarm();
  EXPECT_FALSE(f.posted());
}

// The post and the arming on two threads, in every order the scheduler gives: exactly one of
// them acts, every round (none: a missed wake-up, the bug above; both: a wake-up too many).
TEST(LongSleepFlag, ExactlyOneSideActsWhateverTheInterleaving) {
  commux::detail::LongSleepFlag f;
  constexpr int kRounds = 20000;
  std::atomic<int> go{0};    // the round the poster may run
  std::atomic<int> done{0};  // the rounds the poster has finished
  std::vector<char> post_acted(kRounds, 0);
  std::thread poster([&] {
    for (int r = 0; r < kRounds; ++r) {
      while (go.load() <= r) std::this_thread::yield();
      for (volatile int i = 0; i < (r * 7) % 400; i = i + 1) {
      }
      post_acted[r] = f.posted() ? 1 : 0;
      done.store(r + 1);
    }
  });
  int wrong = 0;
  int posts_acted = 0;
  for (int r = 0; r < kRounds; ++r) {
    const std::uint64_t seen = f.posts();
    go.store(r + 1);
    for (volatile int i = 0; i < (r * 5) % 1100; i = i + 1) {  // the poster's wake-up: ~1 us
    }
    const bool arm_acted = f.arm(seen);
    while (done.load() <= r) std::this_thread::yield();
    f.disarm();
    posts_acted += post_acted[r];
    if (static_cast<int>(arm_acted) + post_acted[r] != 1) ++wrong;
  }
  poster.join();
  EXPECT_EQ(wrong, 0) << "of " << kRounds << " rounds";
  std::printf("the post acted in %d of %d rounds, the arming in the rest\n", posts_acted, kRounds);
}
