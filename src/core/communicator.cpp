#include "commux/communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "backoff.hpp"
#include "commux/settings.hpp"
#include "engine.hpp"

namespace commux {

const char* memory_type_name(MemoryType m) noexcept {
  switch (m) {
    case MemoryType::kHost: return "host";
    case MemoryType::kCuda: return "cuda";
    case MemoryType::kCudaManaged: return "cuda-managed";
    case MemoryType::kRocm: return "rocm";
    case MemoryType::kZe: return "ze";
    case MemoryType::kUnknown: return "unknown";
  }
  return "unknown";
}

Options Options::from_env() {
  const Settings s = Settings::from_environment();  // read at each communicator's creation
  Options o;
  if (s.coalesce) o.packing = Packing::kIov;
  o.defer_in_window = s.group;
  o.spin = s.spin;
  o.timeout = s.timeout;
  o.shutdown_timeout = s.shutdown_timeout;
  switch (s.wakeup) {
    case Settings::Wakeup::kAuto: o.wakeup = Options::Wakeup::kAuto; break;
    case Settings::Wakeup::kOn: o.wakeup = Options::Wakeup::kOn; break;
    case Settings::Wakeup::kOff: o.wakeup = Options::Wakeup::kOff; break;
  }
  switch (s.yield) {
    case Settings::Yield::kAuto: o.yield = Options::Yield::kAuto; break;
    case Settings::Yield::kOn: o.yield = Options::Yield::kOn; break;
    case Settings::Yield::kOff: o.yield = Options::Yield::kOff; break;
  }
  return o;
}

// --- Request ---------------------------------------------------------------------------------

namespace {
void require(const std::shared_ptr<detail::RequestState>& state) {
  if (!state)
    throw Error(Errc::kInvalidArgument, ErrorSite{"request", {}, {}, {}, {}}, "empty Request");
}
}  // namespace

bool Request::test() {
  require(state_);
  return state_->test();
}

void Request::wait() {
  require(state_);
  wait(state_->default_timeout());
}

void Request::wait(std::chrono::milliseconds timeout) {
  require(state_);
  try {
    state_->wait_for(timeout);
  } catch (const Error& e) {
    // Only a timeout leaves the operation posted (a failure is the outcome, read below).
    throw e.with_still_posted(true);
  }
  if (auto error = state_->failure()) std::rethrow_exception(error);
}

bool Request::done() const noexcept { return state_ && state_->finished(); }

int Request::source() const {
  require(state_);
  return state_->finished() ? state_->sender() : state_->posted_peer();
}

std::size_t Request::bytes() const {
  require(state_);
  return state_->finished() ? state_->transferred() : 0;
}

std::exception_ptr Request::error() const {
  require(state_);
  return state_->finished() ? state_->failure() : nullptr;
}

void Request::cancel() {
  require(state_);
  state_->request_cancel();
}

namespace detail {

Request make_request(std::shared_ptr<RequestState> state) noexcept {
  return Request(std::move(state));
}

RequestState* state_of(const Request& request) noexcept { return request.state_.get(); }

namespace {
// A message sent or received inside its call (Channel::send_now, recv_now): nothing posted, so
// nothing to progress, wait for or cancel.
class DoneState final : public RequestState {
 public:
  DoneState(int peer, std::size_t bytes, std::chrono::milliseconds timeout) noexcept
      : peer_(peer), bytes_(bytes), timeout_(timeout) {}
  bool test() override { return true; }
  void wait_for(std::chrono::milliseconds /*timeout*/) override {}
  bool await(std::chrono::milliseconds /*timeout*/, bool /*spin*/, bool /*goes_on*/) override {
    return true;
  }
  void request_cancel() override {}  // (too late: it was sent, as for a send that matched)
  bool finished() const noexcept override { return true; }
  int posted_peer() const noexcept override { return peer_; }
  int sender() const noexcept override { return peer_; }
  std::size_t transferred() const noexcept override { return bytes_; }
  std::exception_ptr failure() const noexcept override { return nullptr; }
  std::chrono::milliseconds default_timeout() const noexcept override { return timeout_; }

 private:
  int peer_;
  std::size_t bytes_;
  std::chrono::milliseconds timeout_;
};
}  // namespace

Request done_request(int peer, std::size_t bytes, std::chrono::milliseconds default_timeout) {
  return make_request(std::make_shared<DoneState>(peer, bytes, default_timeout));
}

Channel& channel(Communicator& comm) noexcept { return *comm.channel_; }

Request Channel::post_after(std::shared_ptr<Gate> gate, Direction dir, const char* name,
                            const Buffer* buffers, std::size_t count, int peer, TagKind kind,
                            std::uint32_t tag, bool fast_completion) {
  if (gate) {
    const auto deadline = std::chrono::steady_clock::now() + options().timeout;
    PollBackoff nap(std::chrono::microseconds(20), kEventPollCap, kEventPollLongCap);
    while (!gate->open()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        throw Error(Errc::kTimeout, ErrorSite{name, peer, tag, {}, std::to_string(options().group)},
                    "waited " + std::to_string(options().timeout.count()) + " ms for " +
                        gate->describe() + "; nothing was posted");
      }
      std::this_thread::sleep_for(nap.next());
    }
  }
  return post(dir, name, buffers, count, peer, kind, tag, fast_completion);
}

Request Channel::move_or_post(Direction dir, const char* name, const Buffer* buffers,
                              std::size_t count, int peer, TagKind kind, std::uint32_t tag,
                              bool fast_completion) {
  if (count == 1 && dir == Direction::kSend && send_now(buffers[0], peer, kind, tag)) {
    return done_request(peer, buffers[0].size, options().timeout);
  }
  if (count == 1 && dir == Direction::kRecv && peer != kAnySource) {
    std::size_t got = 0;
    Request posted;
    if (recv_now(name, buffers[0], peer, kind, tag, &got, &posted)) {
      return done_request(peer, got, options().timeout);
    }
    if (posted.valid()) return posted;
  }
  return post(dir, name, buffers, count, peer, kind, tag, fast_completion);
}

std::unique_ptr<Communicator> communicator_over(std::shared_ptr<Channel> channel) {
  if (!channel) throw Error(Errc::kInvalidArgument, "commux init: no channel given");
  return std::unique_ptr<Communicator>(new Communicator(std::move(channel)));
}

}  // namespace detail

RuntimeInfo probe_runtime(const Options& options) {
  char tmpl[] = "/tmp/commux-probe-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (dir == nullptr) {
    throw Error(Errc::kInvalidArgument,
                std::string("commux probe: mkdtemp in /tmp failed: ") + std::strerror(errno));
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  Communicator comm(std::make_shared<FileStore>(dir), 0, 1, options);
  return comm.runtime_info();
}

// --- Communicator ----------------------------------------------------------------------------

namespace {
std::shared_ptr<detail::Engine> started_engine(std::shared_ptr<Store> store, int rank, int size,
                                               Options options) {
  auto engine = std::make_shared<detail::Engine>(std::move(store), rank, size, std::move(options));
  engine->start();
  return engine;
}
}  // namespace

Communicator::Communicator(std::shared_ptr<Store> store, int rank, int size, Options options)
    : channel_(started_engine(std::move(store), rank, size, std::move(options))) {}

Communicator::Communicator(std::shared_ptr<detail::Channel> channel)
    : channel_(std::move(channel)) {}

Communicator::~Communicator() { shutdown(); }

void Communicator::shutdown() {
  if (channel_) channel_->shutdown();
}

int Communicator::rank() const noexcept { return channel_->rank(); }
int Communicator::size() const noexcept { return channel_->size(); }
const Options& Communicator::options() const noexcept { return channel_->options(); }
const RuntimeInfo& Communicator::runtime_info() const noexcept { return channel_->info(); }

Request Communicator::isend(const std::vector<Buffer>& buffers, int peer, std::int64_t tag) {
  const std::uint32_t t = check_user_tag(tag, "isend");
  // A small message the transport takes inside the call is sent: its Request comes finished.
  return channel_->move_or_post(detail::Direction::kSend, "isend", buffers.data(), buffers.size(),
                                peer, TagKind::kUser, t, false);
}

Request Communicator::irecv(const std::vector<Buffer>& buffers, int peer, std::int64_t tag) {
  const std::uint32_t t = check_user_tag(tag, "irecv");
  // A message that is there already is received inside the call: its Request comes finished.
  return channel_->move_or_post(detail::Direction::kRecv, "irecv", buffers.data(), buffers.size(),
                                peer, TagKind::kUser, t, false);
}

// The blocking forms never return with the operation still posted: the caller gets no Request
// to cancel, and its buffers may be gone. On a timeout the operation is cancelled and waited for
// (bounded by the shutdown timeout) before the timeout error is thrown.
void Communicator::wait_or_cancel(Request& r) {
  detail::RequestState& op = *r.state_;
  try {
    op.wait_for(options().timeout);
  } catch (const Error& timeout) {
    op.request_cancel();
    try {
      op.wait_for(options().shutdown_timeout);
    } catch (const Error&) {
      throw Error(Errc::kTimeout, timeout.site(),
                  timeout.reason() +
                      "; cancelling it did not finish either, so its buffers "
                      "must stay alive until the communicator is shut down");
    }
    if (op.failure() != nullptr) {
      throw Error(Errc::kTimeout, timeout.site(),
                  timeout.reason() + "; the operation was cancelled");
    }
    // It matched while being cancelled: a success after all.
  }
  if (auto error = op.failure()) std::rethrow_exception(error);
}

void Communicator::send(const std::vector<Buffer>& buffers, int peer, std::int64_t tag) {
  const std::uint32_t t = check_user_tag(tag, "send");
  // A small message the transport takes inside the call is sent: nothing to post or wait for.
  if (buffers.size() == 1 && channel_->send_now(buffers[0], peer, TagKind::kUser, t)) return;
  Request r = channel_->post(detail::Direction::kSend, "send", buffers.data(), buffers.size(), peer,
                             TagKind::kUser, t, true);
  wait_or_cancel(r);
}

Request Communicator::recv(const std::vector<Buffer>& buffers, int peer, std::int64_t tag) {
  const std::uint32_t t = check_user_tag(tag, "recv");
  // A message that is there already is received inside the call: nothing to wait for.
  Request r = channel_->move_or_post(detail::Direction::kRecv, "recv", buffers.data(),
                                     buffers.size(), peer, TagKind::kUser, t, false);
  wait_or_cancel(r);
  return r;
}

}  // namespace commux
