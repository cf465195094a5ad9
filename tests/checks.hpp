// Checks shared by the GoogleTest suites and the test_commux driver. Each runs on every rank of any
// world size and throws (via CX_CHECK) on a wrong result. This file and checks.cpp use no
// GoogleTest, so the driver builds where GoogleTest is absent.
//
// Where the messages live: a check fills and verifies host vectors, and a Space says where the
// transfer happens. In host memory (host_space(), what the GoogleTest suites and the driver's CPU
// mode use) a message is the vector itself; in a device space (the driver's CUDA mode) it is a
// device copy, uploaded from the vector before it is sent and downloaded into it to be verified.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "harness.hpp"

namespace commux::test {

std::vector<unsigned char> filled(std::uint64_t id, std::size_t n);
void check_filled(const std::vector<unsigned char>& v, std::uint64_t id, std::size_t n);
inline Buffer buf(std::vector<unsigned char>& v) { return Buffer{v.data(), v.size()}; }

// Memory the checks' messages can live in. A device space's transfers are complete when
// upload/download return (the next send, or the verification, sees the bytes).
class Space {
 public:
  virtual ~Space() = default;
  virtual MemoryType type() const = 0;
  // At least `bytes` bytes (at least one, so even an empty message has an address).
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void release(void* p) noexcept = 0;
  virtual void upload(void* dst, const void* host_src, std::size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, std::size_t bytes) = 0;
};
// Host memory: messages are their host vectors (no copies).
Space& host_space();

// One message of a check, in `space`. Owns its memory; the caller keeps it alive until the request
// that uses buffer() completes.
class Msg {
 public:
  Msg() = default;
  Msg(Space& space, std::vector<unsigned char> contents);
  Msg(Msg&& other) noexcept;
  Msg& operator=(Msg&& other) noexcept;
  Msg(const Msg&) = delete;
  Msg& operator=(const Msg&) = delete;
  ~Msg();

  std::size_t size() const { return host_.size(); }
  // Where the message lives, with its memory type (the address stays the same for its lifetime).
  Buffer buffer();
  // The message's bytes as they are now (downloaded first from device memory).
  const std::vector<unsigned char>& fetch();
  // Overwrites the message with `contents` (of size()).
  void store(const std::vector<unsigned char>& contents);

 private:
  Space* space_ = nullptr;
  std::vector<unsigned char> host_;
  void* mem_ = nullptr;  // the device copy; nullptr in host memory
};

// --- Point-to-point, every message in `space` ---
// Every rank sends to every rank (itself included) with counts 0, 1, odd and 1 MiB.
void check_all_pairs_in(Communicator& c, Space& space);
// 16 tagged messages to the right-hand neighbour, posted in a different shuffled order on each
// side, sizes across the eager/rendezvous boundary.
void check_out_of_order_tags_in(Communicator& c, Space& space);
// 40 messages on one (sender, tag), eager and rendezvous mixed, arrive in posting order.
void check_same_tag_order_in(Communicator& c, Space& space);
// Rank 0 receives from every other rank with kAnySource and sees each real sender once.
void check_any_source_in(Communicator& c, Space& space);
// A 4-buffer message (one empty) to the right-hand neighbour, by exact and any source.
void check_multi_buffer_in(Communicator& c, Space& space);

// The same in host memory (what the GoogleTest suites run).
inline void check_all_pairs(Communicator& c) { check_all_pairs_in(c, host_space()); }
inline void check_out_of_order_tags(Communicator& c) {
  check_out_of_order_tags_in(c, host_space());
}
inline void check_same_tag_order(Communicator& c) { check_same_tag_order_in(c, host_space()); }
inline void check_any_source(Communicator& c) { check_any_source_in(c, host_space()); }
inline void check_multi_buffer(Communicator& c) { check_multi_buffer_in(c, host_space()); }

// --- Across memory types ---
// Every rank sends from host memory to its right-hand neighbour, which receives into `device`, then
// the other way round (eager and rendezvous sizes); with separate parts (not COMMUX_COALESCE), also
// one message whose buffer list mixes both memories on both sides.
void check_mixed_memory(Communicator& c, Space& device);

// --- Collectives (commux::coll, Context::mem = space.type()) ---
// float32 SUM in place, 1, 1000 and 1<<20 elements (exact whatever the order of the additions).
void check_coll_allreduce(Communicator& c, Space& space);
// From the first and the last rank, 1, 1001 and 1 MiB bytes.
void check_coll_broadcast(Communicator& c, Space& space);
// 1, 1001 and 256 KiB bytes per rank.
void check_coll_allgather(Communicator& c, Space& space);

}  // namespace commux::test
