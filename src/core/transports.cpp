// choose_transports: pure logic on names, unit-tested with injected inputs (tests/test_transports).
#include "commux/transports.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace commux {

const char* accelerator_name(Accelerator a) noexcept {
  switch (a) {
    case Accelerator::kNone: return "none";
    case Accelerator::kCuda: return "cuda";
    case Accelerator::kRocm: return "rocm";
    case Accelerator::kXpu: return "xpu";
    case Accelerator::kUnknown: return "unknown";
  }
  return "unknown";
}

namespace {

struct Family {
  const char* copy;                 // the UCX_TLS name of the copy transport
  std::vector<const char*> extras;  // used when present
  const char* alias;                // UCX_TLS alias that covers the family
  const char* fix;                  // how to get a UCX with it
};

const Family* family(Accelerator a) {
  static const Family cuda{"cuda_copy",
                           {"cuda_ipc", "gdr_copy"},
                           "cuda",
                           "install a UCX built with CUDA (pip install libucx-cu13, the default "
                           "provider of commux's wheel)"};
  static const Family rocm{"rocm_copy",
                           {"rocm_ipc"},
                           "rocm",
                           "use a UCX built with ROCm (configure --with-rocm) and point commux at "
                           "it (UCX_ROOT / COMMUX_UCX_PROVIDER=system)"};
  static const Family xpu{"ze_copy",
                          {"ze_ipc"},
                          "ze",
                          "use a UCX built with Level Zero (configure --with-ze) and point commux "
                          "at it (UCX_ROOT / COMMUX_UCX_PROVIDER=system)"};
  switch (a) {
    case Accelerator::kCuda: return &cuda;
    case Accelerator::kRocm: return &rocm;
    case Accelerator::kXpu: return &xpu;
    default: return nullptr;
  }
}

// UCX's internal names differ from the UCX_TLS names for a few transports.
std::string canonical(const std::string& name) {
  if (name == "rocm_cpy") return "rocm_copy";
  return name;
}

bool has(const std::vector<std::string>& available, const char* tl) {
  return std::any_of(available.begin(), available.end(),
                     [&](const std::string& a) { return canonical(a) == tl; });
}

std::vector<std::string> split_tls(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    std::string item = list.substr(start, end - start);
    // "cuda_copy:aux" style qualifiers name the same transport.
    item = item.substr(0, item.find(':'));
    if (!item.empty()) out.push_back(item);
    start = end + 1;
  }
  return out;
}

}  // namespace

TransportChoice choose_transports(Accelerator accelerator,
                                  const std::vector<std::string>& available, const char* user_tls,
                                  const std::string& other) {
  TransportChoice c;
  c.accelerator = accelerator;
  if (accelerator == Accelerator::kUnknown) {
    c.warnings.push_back("commux: no UCX copy transport is known for the accelerator '" +
                         (other.empty() ? std::string("unknown") : other) +
                         "'; its tensors would be read as host memory, so only CPU tensors are "
                         "supported on it");
    return c;
  }
  const Family* f = family(accelerator);
  if (f == nullptr) return c;  // kNone
  c.copy_transport = f->copy;
  c.copy_available = has(available, f->copy);
  if (c.copy_available) {
    c.transports.push_back(f->copy);
    for (const char* e : f->extras) {
      if (has(available, e)) c.transports.push_back(e);
    }
  } else {
    c.warnings.push_back(std::string("commux: this UCX has no ") + f->copy + " transport, so " +
                         accelerator_name(accelerator) + " tensors cannot be sent; " + f->fix);
  }
  if (user_tls == nullptr || *user_tls == '\0') return c;  // UCX selects; nothing to check

  const std::string tls = user_tls;
  const bool deny = tls[0] == '^';
  const auto items = split_tls(deny ? tls.substr(1) : tls);
  const bool named = std::any_of(items.begin(), items.end(), [&](const std::string& i) {
    return i == f->copy || i == f->alias || (!deny && i == "all");
  });
  c.copy_allowed = deny ? !named : named;
  if (!c.copy_allowed) {
    c.warnings.push_back(
        "commux: UCX_TLS=" + tls + (deny ? " excludes " : " does not include ") + f->copy +
        ", so UCX will not detect " + accelerator_name(accelerator) +
        " memory and device tensors will fail; " +
        (deny ? "remove it from the deny list" : "add " + std::string(f->copy) + " to the list") +
        " (commux leaves your UCX_TLS as it is)");
  }
  return c;
}

}  // namespace commux
