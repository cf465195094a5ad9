// A C++ program that uses the installed commux package the way a C++ user would:
// commux::ProcessGroupUCX as the backend of a c10d::ProcessGroup for CPU and CUDA.
// Usage: consumer RANK SIZE STORE_PATH
#include <commux/process_group_ucx.hpp>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdio>
#include <cstdlib>

#define CHECK(cond)                                                                         \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "rank %d: check failed: %s (line %d)\n", rank, #cond, __LINE__); \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  auto store = c10::make_intrusive<c10d::FileStore>(argv[3], size);
  auto ucx =
      c10::make_intrusive<commux::ProcessGroupUCX>(store, rank, size, std::chrono::seconds(30));
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, ucx);
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, ucx);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  CHECK(ucx->getBackendName() == "ucx");

  // allreduce through the ProcessGroup (the c10d dispatcher picks our backend for CPU tensors).
  std::vector<at::Tensor> t{at::full({5}, static_cast<double>(rank + 1), at::kDouble)};
  pg->allreduce(t)->wait();
  CHECK(at::equal(t[0], at::full({5}, size * (size + 1) / 2.0, at::kDouble)));

  // Tagged point-to-point around a ring, receives posted before sends, tags exact.
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  std::vector<at::Tensor> a{at::zeros({3}, at::kLong)}, b{at::zeros({3}, at::kLong)};
  auto ra = pg->recv(a, left, 11);
  auto rb = pg->recv(b, left, 10);
  std::vector<at::Tensor> s10{at::full({3}, 100 + left * 0 + rank, at::kLong)};
  std::vector<at::Tensor> s11{at::full({3}, 200 + rank, at::kLong)};
  auto w10 = pg->send(s10, right, 10);
  auto w11 = pg->send(s11, right, 11);
  ra->wait();
  rb->wait();
  w10->wait();
  w11->wait();
  CHECK(a[0][0].item<int64_t>() == 200 + left);
  CHECK(b[0][0].item<int64_t>() == 100 + left);

  pg->barrier()->wait();
  ucx->shutdown();
  std::printf("rank %d: consumer OK\n", rank);
  return 0;
}
