// Gather and scatter: direct. The root posts all n - 1 receives (sends) at once, each rank
// exchanges one message with the root; the root's own block is a local copy.
#include <string>
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

void gather(const Context& ctx, const void* in, std::size_t bytes, void* out, int root) {
  detail::Exchange ex(ctx);
  const int n = ex.size(), r = ex.rank();
  detail::check_root(ctx, root, n);
  detail::check_ptr(ctx, in, bytes, "in");
  ex.phase("direct");
  if (r != root) {
    ex.send_user(in, bytes, root);
    ex.wait_all();
    return;
  }
  detail::check_ptr(ctx, out, bytes * static_cast<std::size_t>(n), "out");
  char* o = static_cast<char*>(out);
  std::vector<std::size_t> recvs(static_cast<std::size_t>(n));
  for (int i = 1; i < n; ++i) {
    const int p = pattern::mod(root + i, n);
    recvs[static_cast<std::size_t>(p)] = ex.recv_user(o + static_cast<std::size_t>(p) * bytes, bytes, p);
  }
  ex.copy(o + static_cast<std::size_t>(r) * bytes, ex.mem(), in, ex.mem(), bytes);
  for (int i = 1; i < n; ++i) {
    const int p = pattern::mod(root + i, n);
    const std::size_t id = recvs[static_cast<std::size_t>(p)];
    ex.wait(id);
    if (ex.bytes(id) != bytes) {
      ex.fail(Errc::kInvalidArgument, detail::size_mismatch(p, ex.bytes(id), bytes, nullptr));
    }
  }
}

void scatter(const Context& ctx, const void* in, void* out, std::size_t bytes, int root) {
  detail::Exchange ex(ctx);
  const int n = ex.size(), r = ex.rank();
  detail::check_root(ctx, root, n);
  detail::check_ptr(ctx, out, bytes, "out");
  ex.phase("direct");
  if (r != root) {
    const std::size_t id = ex.recv_user(out, bytes, root);
    ex.wait(id);
    if (ex.bytes(id) != bytes) {
      ex.fail(Errc::kInvalidArgument, detail::size_mismatch(root, ex.bytes(id), bytes, nullptr));
    }
    return;
  }
  detail::check_ptr(ctx, in, bytes * static_cast<std::size_t>(n), "in");
  const char* i0 = static_cast<const char*>(in);
  for (int i = 1; i < n; ++i) {
    const int p = pattern::mod(root + i, n);
    ex.send_user(i0 + static_cast<std::size_t>(p) * bytes, bytes, p);
  }
  ex.copy(out, ex.mem(), i0 + static_cast<std::size_t>(r) * bytes, ex.mem(), bytes);
  ex.wait_all();
}

}  // namespace commux::coll
