#include "checks.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>

#include "commux/collectives.hpp"

namespace commux::test {

// Declared in harness.hpp; defined here so that the checks (and the driver) need no GoogleTest.
void check_failed(const char* file, int line, const std::string& what) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what);
}

std::string expect_error(Errc code, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.code() != code) {
      check_failed(__FILE__, __LINE__,
                   std::string("expected error '") + errc_name(code) + "' but got '" +
                       errc_name(e.code()) + "': " + e.what());
    }
    return e.what();
  }
  check_failed(__FILE__, __LINE__,
               std::string("expected error '") + errc_name(code) + "' but nothing was thrown");
}

std::vector<unsigned char> filled(std::uint64_t id, std::size_t n) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = pattern(id, i);
  return v;
}

void check_filled(const std::vector<unsigned char>& v, std::uint64_t id, std::size_t n) {
  CX_CHECK_EQ(v.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] != pattern(id, i)) {
      check_failed(__FILE__, __LINE__,
                   "byte " + std::to_string(i) + " of message " + std::to_string(id) + " is wrong");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Spaces and messages

namespace {

class HostSpace final : public Space {
 public:
  MemoryType type() const override { return MemoryType::kHost; }
  void* allocate(std::size_t bytes) override {
    void* p = std::malloc(std::max<std::size_t>(bytes, 1));
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
  void upload(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
};

}  // namespace

Space& host_space() {
  static HostSpace space;
  return space;
}

Msg::Msg(Space& space, std::vector<unsigned char> contents)
    : space_(&space), host_(std::move(contents)) {
  if (space.type() == MemoryType::kHost) return;
  mem_ = space.allocate(host_.size());
  try {
    space.upload(mem_, host_.data(), host_.size());
  } catch (...) {
    space.release(mem_);
    throw;
  }
}

Msg::Msg(Msg&& other) noexcept
    : space_(other.space_),
      host_(std::move(other.host_)),
      mem_(std::exchange(other.mem_, nullptr)) {}

Msg& Msg::operator=(Msg&& other) noexcept {
  if (this != &other) {
    if (mem_ != nullptr) space_->release(mem_);
    space_ = other.space_;
    host_ = std::move(other.host_);
    mem_ = std::exchange(other.mem_, nullptr);
  }
  return *this;
}

Msg::~Msg() {
  if (mem_ != nullptr) space_->release(mem_);
}

Buffer Msg::buffer() {
  if (mem_ == nullptr) return Buffer{host_.data(), host_.size(), MemoryType::kHost};
  return Buffer{mem_, host_.size(), space_->type()};
}

const std::vector<unsigned char>& Msg::fetch() {
  if (mem_ != nullptr) space_->download(host_.data(), mem_, host_.size());
  return host_;
}

void Msg::store(const std::vector<unsigned char>& contents) {
  CX_CHECK_EQ(contents.size(), host_.size());
  std::copy(contents.begin(), contents.end(), host_.begin());  // keeps host_'s address
  if (mem_ != nullptr) space_->upload(mem_, host_.data(), host_.size());
}

// ---------------------------------------------------------------------------------------------
// Point-to-point

namespace {
int right(const Communicator& c) { return (c.rank() + 1) % c.size(); }
int left(const Communicator& c) { return (c.rank() + c.size() - 1) % c.size(); }
std::vector<unsigned char> zeros(std::size_t n) { return std::vector<unsigned char>(n, 0); }
}  // namespace

void check_all_pairs_in(Communicator& c, Space& s) {
  const int me = c.rank(), size = c.size();
  for (std::size_t count :
       {std::size_t{0}, std::size_t{1}, std::size_t{1001}, std::size_t{1} << 20}) {
    std::vector<Msg> out(size), in(size);
    std::vector<Request> recvs, sends;
    for (int p = 0; p < size; ++p) {
      in[p] = Msg(s, zeros(count));
      recvs.push_back(c.irecv(in[p].buffer(), p, 7));
    }
    for (int p = 0; p < size; ++p) {
      out[p] = Msg(s, filled(static_cast<std::uint64_t>(me * 100 + p), count));
      sends.push_back(c.isend(out[p].buffer(), p, 7));
    }
    for (auto& r : sends) r.wait();
    for (int p = 0; p < size; ++p) {
      Request& r = recvs[static_cast<std::size_t>(p)];
      r.wait();
      check_filled(in[p].fetch(), static_cast<std::uint64_t>(p * 100 + me), count);
      CX_CHECK_EQ(r.bytes(), count);
      CX_CHECK_EQ(r.source(), p);
    }
  }
}

void check_out_of_order_tags_in(Communicator& c, Space& s) {
  std::vector<int> send_tags(16), recv_tags(16);
  std::iota(send_tags.begin(), send_tags.end(), 100);
  recv_tags = send_tags;
  std::mt19937 rng(static_cast<unsigned>(1234 + c.rank()));
  std::shuffle(send_tags.begin(), send_tags.end(), rng);
  std::shuffle(recv_tags.begin(), recv_tags.end(), rng);
  auto size_of = [](int tag) { return static_cast<std::size_t>((tag % 4) * 90000 + tag); };
  auto id = [](int from, int tag) { return static_cast<std::uint64_t>(from * 1000 + tag); };
  std::vector<Msg> out(16), in(16);
  std::vector<Request> reqs;
  for (std::size_t i = 0; i < 16; ++i) {
    in[i] = Msg(s, zeros(size_of(recv_tags[i])));
    reqs.push_back(c.irecv(in[i].buffer(), left(c), recv_tags[i]));
    out[i] = Msg(s, filled(id(c.rank(), send_tags[i]), size_of(send_tags[i])));
    reqs.push_back(c.isend(out[i].buffer(), right(c), send_tags[i]));
  }
  for (auto& r : reqs) r.wait();
  for (std::size_t i = 0; i < 16; ++i) {
    check_filled(in[i].fetch(), id(left(c), recv_tags[i]), size_of(recv_tags[i]));
  }
}

void check_same_tag_order_in(Communicator& c, Space& s) {
  const int kMsgs = 40;
  auto size_of = [](int i) { return static_cast<std::size_t>((i % 3 == 0) ? 200000 + i : 50 + i); };
  auto id = [](int from, int i) { return static_cast<std::uint64_t>(from * 1000 + i); };
  std::vector<Msg> out(kMsgs), in(kMsgs);
  std::vector<Request> reqs;
  for (int i = 0; i < kMsgs; ++i) {
    in[i] = Msg(s, zeros(size_of(i)));
    reqs.push_back(c.irecv(in[i].buffer(), left(c), 3));
  }
  for (int i = 0; i < kMsgs; ++i) {
    out[i] = Msg(s, filled(id(c.rank(), i), size_of(i)));
    reqs.push_back(c.isend(out[i].buffer(), right(c), 3));
  }
  for (auto& r : reqs) r.wait();
  for (int i = 0; i < kMsgs; ++i) check_filled(in[i].fetch(), id(left(c), i), size_of(i));
}

void check_any_source_in(Communicator& c, Space& s) {
  if (c.rank() == 0) {
    std::vector<Msg> in(static_cast<std::size_t>(c.size() - 1));
    std::vector<Request> reqs;
    for (auto& m : in) {
      m = Msg(s, zeros(64));
      reqs.push_back(c.irecv(m.buffer(), kAnySource, 5));
    }
    std::set<int> seen;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].wait();
      const int src = reqs[i].source();
      CX_CHECK(src >= 1 && src < c.size());
      CX_CHECK(seen.insert(src).second);
      check_filled(in[i].fetch(), static_cast<std::uint64_t>(src), 64);
    }
  } else {
    Msg out(s, filled(static_cast<std::uint64_t>(c.rank()), 64));
    c.send({out.buffer()}, 0, 5);
  }
}

void check_multi_buffer_in(Communicator& c, Space& s) {
  const std::vector<std::size_t> sizes = {10, 0, 70000, 3};
  const std::size_t total = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
  std::vector<Msg> out(sizes.size()), in(sizes.size());
  std::vector<Buffer> out_bufs, in_bufs;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out[i] = Msg(s, filled(static_cast<std::uint64_t>(c.rank() * 10) + i, sizes[i]));
    in[i] = Msg(s, zeros(sizes[i]));
    out_bufs.push_back(out[i].buffer());
    in_bufs.push_back(in[i].buffer());
  }
  for (int round = 0; round < 2; ++round) {
    const bool any = round == 1;
    const int tag = 11 + round;
    for (auto& m : in) m.store(zeros(m.size()));
    Request r = c.irecv(in_bufs, any ? kAnySource : left(c), tag);
    c.send(out_bufs, right(c), tag);
    r.wait();
    CX_CHECK_EQ(r.bytes(), total);
    CX_CHECK_EQ(r.source(), left(c));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      check_filled(in[i].fetch(), static_cast<std::uint64_t>(left(c) * 10) + i, sizes[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Across memory types

void check_mixed_memory(Communicator& c, Space& device) {
  auto id = [](int from, std::size_t n, int round) {
    return static_cast<std::uint64_t>(from) * 1000003u + n * 7u + static_cast<std::uint64_t>(round);
  };
  for (int round = 0; round < 2; ++round) {
    Space& from = round == 0 ? host_space() : device;
    Space& to = round == 0 ? device : host_space();
    const int tag = 21 + round;
    for (std::size_t n : {std::size_t{1}, std::size_t{1001}, std::size_t{1} << 20}) {
      Msg in(to, zeros(n));
      Request r = c.irecv(in.buffer(), left(c), tag);
      Msg out(from, filled(id(c.rank(), n, round), n));
      c.send({out.buffer()}, right(c), tag);
      r.wait();
      CX_CHECK_EQ(r.bytes(), n);
      CX_CHECK_EQ(r.source(), left(c));
      check_filled(in.fetch(), id(left(c), n, round), n);
    }
  }
  // COMMUX_COALESCE packs a buffer list into one UCX message, which has one memory type.
  if (c.options().packing != Packing::kParts) return;
  const std::size_t sizes[] = {5000, 300000};
  Msg out[] = {Msg(host_space(), filled(id(c.rank(), 0, 7), sizes[0])),
               Msg(device, filled(id(c.rank(), 1, 7), sizes[1]))};
  Msg in[] = {Msg(device, zeros(sizes[0])), Msg(host_space(), zeros(sizes[1]))};
  Request r = c.irecv({in[0].buffer(), in[1].buffer()}, left(c), 23);
  c.send({out[0].buffer(), out[1].buffer()}, right(c), 23);
  r.wait();
  CX_CHECK_EQ(r.bytes(), sizes[0] + sizes[1]);
  check_filled(in[0].fetch(), id(left(c), 0, 7), sizes[0]);
  check_filled(in[1].fetch(), id(left(c), 1, 7), sizes[1]);
}

// ---------------------------------------------------------------------------------------------
// Collectives

namespace {

coll::Context coll_context(Communicator& c, Space& s, std::uint32_t tag, const char* op) {
  coll::Context ctx;
  ctx.comm = &c;
  ctx.tag = tag;
  ctx.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  ctx.mem = s.type();
  ctx.op_name = op;
  return ctx;
}

// Bytes [off, off + n) of v hold message `id`.
void check_block(const std::vector<unsigned char>& v, std::size_t off, std::uint64_t id,
                 std::size_t n, const char* what) {
  for (std::size_t i = 0; i < n; ++i) {
    if (v[off + i] != pattern(id, i)) {
      check_failed(__FILE__, __LINE__,
                   std::string(what) + ": byte " + std::to_string(i) + " of block " +
                       std::to_string(id) + " (at offset " + std::to_string(off) + ") is wrong");
    }
  }
}

}  // namespace

void check_coll_allreduce(Communicator& c, Space& s) {
  const int n = c.size();
  std::uint32_t tag = 0x100;
  for (std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20}) {
    // Small integers: every partial sum is exact in float32, so any order gives the same result.
    auto value = [](int rank, std::size_t i) {
      return static_cast<float>((rank + 1) * static_cast<int>(i % 13 + 1));
    };
    std::vector<float> x(count);
    for (std::size_t i = 0; i < count; ++i) x[i] = value(c.rank(), i);
    std::vector<unsigned char> bytes(count * sizeof(float));
    std::memcpy(bytes.data(), x.data(), bytes.size());
    Msg m(s, std::move(bytes));
    coll::allreduce(coll_context(c, s, tag++, "allreduce"), m.buffer().data, count,
                    DataType::kFloat32, ReduceOp::kSum);
    std::memcpy(x.data(), m.fetch().data(), count * sizeof(float));
    for (std::size_t i = 0; i < count; ++i) {
      const float want = static_cast<float>(n * (n + 1) / 2 * static_cast<int>(i % 13 + 1));
      if (x[i] != want) {
        check_failed(__FILE__, __LINE__,
                     "allreduce of " + std::to_string(count) + " floats: element " +
                         std::to_string(i) + " is " + std::to_string(x[i]) + ", expected " +
                         std::to_string(want));
      }
    }
  }
}

void check_coll_broadcast(Communicator& c, Space& s) {
  std::uint32_t tag = 0x200;
  std::vector<int> roots = {0};
  if (c.size() > 1) roots.push_back(c.size() - 1);
  for (int root : roots) {
    for (std::size_t bytes : {std::size_t{1}, std::size_t{1001}, std::size_t{1} << 20}) {
      const auto id = static_cast<std::uint64_t>(root * 7919) + bytes;
      Msg m(s, c.rank() == root ? filled(id, bytes) : zeros(bytes));
      coll::broadcast(coll_context(c, s, tag++, "broadcast"), m.buffer().data, bytes, root);
      check_block(m.fetch(), 0, id, bytes, "broadcast");
    }
  }
}

void check_coll_allgather(Communicator& c, Space& s) {
  std::uint32_t tag = 0x300;
  const auto size = static_cast<std::size_t>(c.size());
  for (std::size_t bytes : {std::size_t{1}, std::size_t{1001}, std::size_t{256} << 10}) {
    auto id = [bytes](int rank) { return static_cast<std::uint64_t>(rank) * 104729u + bytes; };
    Msg in(s, filled(id(c.rank()), bytes));
    Msg out(s, zeros(size * bytes));
    coll::allgather(coll_context(c, s, tag++, "allgather"), in.buffer().data, bytes,
                    out.buffer().data);
    const std::vector<unsigned char>& got = out.fetch();
    for (int p = 0; p < c.size(); ++p) {
      check_block(got, static_cast<std::size_t>(p) * bytes, id(p), bytes, "allgather");
    }
    check_filled(in.fetch(), id(c.rank()), bytes);  // the input is only read
  }
}

}  // namespace commux::test
