// src/c10d/list_buffer.hpp -- one flat buffer standing for a list of tensors (internal).
//
// The list forms of the collectives (all_gather's output list, scatter's and reduce_scatter's input
// lists, all_to_all's two lists, gather's list on the root) run one C++ collective over a flat
// buffer that holds the list's tensors back to back. Where the list already lies that way in
// memory (the chunks of one tensor, as `list(t.chunk(n))` gives), that block is the buffer and
// nothing is copied. Otherwise the list is staged: on the CPU through plain memory that the
// process keeps for the next call (up to 64 MiB), with memcpy for tensors up to 256 KiB, which
// costs a fraction of the torch calls (an empty tensor, a narrow and a copy_ per element) it
// replaces, and copy_ (torch's threaded copy) above; on a device through a byte tensor with copy_
// on the current stream.
#pragma once

#include <ATen/core/Tensor.h>

#include "call_hold.hpp"

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace commux::c10d_detail {

class ListBuffer {
 public:
  // A list of contiguous tensors (validated by the caller) of bytes[i] bytes each, `like` giving
  // the device of the staging buffer. The block is used in place only where it does not overlap
  // `other` ([other, other + other_bytes): the other side of the call), or where `other` is the
  // block's own element `own` (in == out + rank * bytes, which the gathers allow); own < 0: never.
  // `call`: the collective it serves (its staging goes to hold_for when that fails).
  ListBuffer(const CallRef& call, const std::vector<at::Tensor>& list,
             const std::vector<std::size_t>& bytes, const at::Tensor& like, const void* other,
             std::size_t other_bytes, int own = -1);

  ~ListBuffer();
  ListBuffer(const ListBuffer&) = delete;
  ListBuffer& operator=(const ListBuffer&) = delete;

  void* data() const noexcept { return data_; }
  // Byte offset of element i in data().
  const std::vector<std::size_t>& displs() const noexcept { return displs_; }
  // Whether data() is the list's own memory (pack and unpack copy nothing).
  bool in_place() const noexcept { return in_place_; }

  void pack();    // the list's tensors into the buffer
  void unpack();  // the buffer into the list's tensors, after the call succeeded (as done())
  // The call succeeded: nothing uses the buffer any more, so the process may keep it for the next
  // call. Without it (the call threw) the staging goes to hold_for: a transfer the call could not
  // cancel may still read from it or land in it, and it is freed once none is left.
  void done() noexcept { done_ = true; }

 private:
  void copy(std::size_t i, bool in);  // element i into the buffer (in) or out of it

  CallRef call_;
  const std::vector<at::Tensor>& list_;
  const std::vector<std::size_t>& bytes_;
  std::vector<std::size_t> displs_;
  bool done_ = false;
  void* data_ = nullptr;
  bool in_place_ = false;
  std::unique_ptr<std::byte[]> host_;  // CPU staging (kept for the next call when done)
  std::size_t host_bytes_ = 0;
  at::Tensor staging_;  // device staging
};

// Where [a, a + an) and [b, b + bn) share a byte (an empty range shares none).
bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) noexcept;

// The bytes of host staging the process keeps for later calls (tests, diagnostics).
std::size_t kept_staging_bytes() noexcept;

// Held by each process group (ProcessGroupUCX::Impl): when the last one goes, the host staging
// the process keeps is freed, so that a program done with its groups (destroy_process_group())
// gets that memory (up to 128 MiB) back.
class KeptStagingUser {
 public:
  KeptStagingUser() noexcept;
  ~KeptStagingUser();
  KeptStagingUser(const KeptStagingUser&) = delete;
  KeptStagingUser& operator=(const KeptStagingUser&) = delete;
};

// The bytes from the first to the end of the last non-empty element of a list (as ListBuffer's
// `other`); {nullptr, 0} where all are empty.
std::pair<const void*, std::size_t> extent(const std::vector<at::Tensor>& list,
                                           const std::vector<std::size_t>& bytes) noexcept;

}  // namespace commux::c10d_detail
