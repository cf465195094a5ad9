// One rank sends itself a tagged message through an installed commux.
#include <commux/communicator.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  commux::Communicator comm(std::make_shared<commux::FileStore>(argv[1]), 0, 1);
  std::string out = "hello through find_package", in(out.size(), '\0');
  commux::Request r = comm.irecv({in.data(), in.size()}, 0, 42);
  comm.send({{out.data(), out.size()}}, 0, 42);
  r.wait();
  std::printf("consumer: received '%s' from rank %d\n", in.c_str(), r.source());
  return in == out && r.source() == 0 ? 0 : 1;
}
