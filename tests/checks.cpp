#include "checks.hpp"

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

namespace commux::test {

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

namespace {
int right(const Communicator& c) { return (c.rank() + 1) % c.size(); }
int left(const Communicator& c) { return (c.rank() + c.size() - 1) % c.size(); }
}  // namespace

void check_all_pairs(Communicator& c) {
  const int me = c.rank(), size = c.size();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1001}, std::size_t{1} << 20}) {
    std::vector<std::vector<unsigned char>> out(size), in(size);
    std::vector<Request> recvs, sends;
    for (int p = 0; p < size; ++p) {
      in[p].assign(count, 0);
      recvs.push_back(c.irecv(buf(in[p]), p, 7));
    }
    for (int p = 0; p < size; ++p) {
      out[p] = filled(static_cast<std::uint64_t>(me * 100 + p), count);
      sends.push_back(c.isend(buf(out[p]), p, 7));
    }
    for (auto& r : sends) r.wait();
    for (int p = 0; p < size; ++p) {
      Request& r = recvs[static_cast<std::size_t>(p)];
      r.wait();
      check_filled(in[p], static_cast<std::uint64_t>(p * 100 + me), count);
      CX_CHECK_EQ(r.bytes(), count);
      CX_CHECK_EQ(r.source(), p);
    }
  }
}

void check_out_of_order_tags(Communicator& c) {
  std::vector<int> send_tags(16), recv_tags(16);
  std::iota(send_tags.begin(), send_tags.end(), 100);
  recv_tags = send_tags;
  std::mt19937 rng(static_cast<unsigned>(1234 + c.rank()));
  std::shuffle(send_tags.begin(), send_tags.end(), rng);
  std::shuffle(recv_tags.begin(), recv_tags.end(), rng);
  auto size_of = [](int tag) { return static_cast<std::size_t>((tag % 4) * 90000 + tag); };
  auto id = [](int from, int tag) { return static_cast<std::uint64_t>(from * 1000 + tag); };
  std::vector<std::vector<unsigned char>> out(16), in(16);
  std::vector<Request> reqs;
  for (std::size_t i = 0; i < 16; ++i) {
    in[i].assign(size_of(recv_tags[i]), 0);
    reqs.push_back(c.irecv(buf(in[i]), left(c), recv_tags[i]));
    out[i] = filled(id(c.rank(), send_tags[i]), size_of(send_tags[i]));
    reqs.push_back(c.isend(buf(out[i]), right(c), send_tags[i]));
  }
  for (auto& r : reqs) r.wait();
  for (std::size_t i = 0; i < 16; ++i) {
    check_filled(in[i], id(left(c), recv_tags[i]), size_of(recv_tags[i]));
  }
}

void check_same_tag_order(Communicator& c) {
  const int kMsgs = 40;
  auto size_of = [](int i) { return static_cast<std::size_t>((i % 3 == 0) ? 200000 + i : 50 + i); };
  auto id = [](int from, int i) { return static_cast<std::uint64_t>(from * 1000 + i); };
  std::vector<std::vector<unsigned char>> out(kMsgs), in(kMsgs);
  std::vector<Request> reqs;
  for (int i = 0; i < kMsgs; ++i) {
    in[i].assign(size_of(i), 0);
    reqs.push_back(c.irecv(buf(in[i]), left(c), 3));
  }
  for (int i = 0; i < kMsgs; ++i) {
    out[i] = filled(id(c.rank(), i), size_of(i));
    reqs.push_back(c.isend(buf(out[i]), right(c), 3));
  }
  for (auto& r : reqs) r.wait();
  for (int i = 0; i < kMsgs; ++i) check_filled(in[i], id(left(c), i), size_of(i));
}

void check_any_source(Communicator& c) {
  if (c.rank() == 0) {
    std::vector<std::vector<unsigned char>> in(static_cast<std::size_t>(c.size() - 1),
                                               std::vector<unsigned char>(64));
    std::vector<Request> reqs;
    for (auto& v : in) reqs.push_back(c.irecv(buf(v), kAnySource, 5));
    std::set<int> seen;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].wait();
      const int src = reqs[i].source();
      CX_CHECK(src >= 1 && src < c.size());
      CX_CHECK(seen.insert(src).second);
      check_filled(in[i], static_cast<std::uint64_t>(src), 64);
    }
  } else {
    auto out = filled(static_cast<std::uint64_t>(c.rank()), 64);
    c.send({buf(out)}, 0, 5);
  }
}

void check_multi_buffer(Communicator& c) {
  const std::vector<std::size_t> sizes = {10, 0, 70000, 3};
  const std::size_t total = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
  std::vector<std::vector<unsigned char>> out(sizes.size()), in(sizes.size());
  std::vector<Buffer> out_bufs, in_bufs;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out[i] = filled(static_cast<std::uint64_t>(c.rank() * 10) + i, sizes[i]);
    in[i].assign(sizes[i], 0);
    out_bufs.push_back(buf(out[i]));
    in_bufs.push_back(buf(in[i]));
  }
  for (int round = 0; round < 2; ++round) {
    const bool any = round == 1;
    const int tag = 11 + round;
    for (auto& x : in) std::fill(x.begin(), x.end(), 0);
    Request r = c.irecv(in_bufs, any ? kAnySource : left(c), tag);
    c.send(out_bufs, right(c), tag);
    r.wait();
    CX_CHECK_EQ(r.bytes(), total);
    CX_CHECK_EQ(r.source(), left(c));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      check_filled(in[i], static_cast<std::uint64_t>(left(c) * 10) + i, sizes[i]);
    }
  }
}

}  // namespace commux::test
