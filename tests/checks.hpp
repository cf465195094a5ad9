// Point-to-point checks shared by the GoogleTest suite and the test_commux driver. Each runs on
// every rank of any world size and throws (via CX_CHECK) on a wrong result.
#pragma once

#include <vector>

#include "harness.hpp"

namespace commux::test {

std::vector<unsigned char> filled(std::uint64_t id, std::size_t n);
void check_filled(const std::vector<unsigned char>& v, std::uint64_t id, std::size_t n);
inline Buffer buf(std::vector<unsigned char>& v) { return Buffer{v.data(), v.size()}; }

// Every rank sends to every rank (itself included) with counts 0, 1, odd and 1 MiB.
void check_all_pairs(Communicator& c);
// 16 tagged messages to the right-hand neighbour, posted in a different shuffled order on each
// side, sizes across the eager/rendezvous boundary.
void check_out_of_order_tags(Communicator& c);
// 40 messages on one (sender, tag), eager and rendezvous mixed, arrive in posting order.
void check_same_tag_order(Communicator& c);
// Rank 0 receives from every other rank with kAnySource and sees each real sender once.
void check_any_source(Communicator& c);
// A 4-buffer message (one empty) to the right-hand neighbour, by exact and any source.
void check_multi_buffer(Communicator& c);

}  // namespace commux::test
