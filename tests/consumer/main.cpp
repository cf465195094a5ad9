// A torch-free C++ program that uses an installed commux (commux::commux): tagged point-to-point
// around a ring (receives posted first, matched by tag) and an allreduce. Built against a
// `cmake --install` prefix (tests/install_consumer.sh), the wheel's CMake config and FetchContent
// of the repository (python/tests/wheel).
// Usage: consumer RANK SIZE STORE_DIR (every rank the same STORE_DIR).
#include <commux/collectives.hpp>
#include <commux/communicator.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: consumer RANK SIZE STORE_DIR\n");
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  commux::Communicator comm(std::make_shared<commux::FileStore>(argv[3]), rank, size);
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;

  std::string a(16, '\0'), b(16, '\0');
  commux::Request ra = comm.irecv({a.data(), a.size()}, left, 11);
  commux::Request rb = comm.irecv({b.data(), b.size()}, left, 10);
  std::string s10 = "ten from " + std::to_string(rank), s11 = "eleven from " + std::to_string(rank);
  s10.resize(16);
  s11.resize(16);
  comm.send({{s10.data(), s10.size()}}, right, 10);
  comm.send({{s11.data(), s11.size()}}, right, 11);
  ra.wait();
  rb.wait();
  const bool p2p_ok = a.c_str() == "eleven from " + std::to_string(left) &&
                      b.c_str() == "ten from " + std::to_string(left) && ra.source() == left;

  std::vector<double> x(5, rank + 1.0);
  commux::coll::Context ctx;
  ctx.comm = &comm;
  ctx.tag = 1;
  ctx.op_name = "allreduce";
  commux::coll::allreduce(ctx, x.data(), x.size(), commux::DataType::kFloat64,
                          commux::ReduceOp::kSum);
  bool sum_ok = true;
  for (double v : x) sum_ok = sum_ok && v == size * (size + 1) / 2.0;
  commux::coll::barrier(ctx);
  if (!p2p_ok || !sum_ok) {
    std::fprintf(stderr, "rank %d: p2p %s ('%s', '%s'), allreduce %s (%g)\n", rank,
                 p2p_ok ? "ok" : "WRONG", a.c_str(), b.c_str(), sum_ok ? "ok" : "WRONG", x[0]);
    return 1;
  }
  std::printf("rank %d: consumer OK\n", rank);
  return 0;
}
