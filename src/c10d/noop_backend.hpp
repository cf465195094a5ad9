// src/c10d/noop_backend.hpp -- "noop": a c10d backend that communicates nothing (internal).
//
// The reference of the collectives benchmark (bench/suites/coll.py): registered like "ucx" (a
// creator passed to torch.distributed.Backend.register_backend, making this C++ backend through
// commux._C) and run beside it in one launch, its time per call is what torch.distributed itself
// costs before and after any backend (the Python API, the dispatcher, the ProcessGroup, a Work
// and its wait), so that "ucx" minus "noop" is commux's share.
//
// Every operation the benchmark calls returns a Work that is already complete and leaves its
// tensors as they were: no copy, no check, so the cost does not grow with the size (torch's own
// FakeProcessGroup copies inputs to outputs in allgather, reduce_scatter and alltoall from torch
// 2.13 on). Its results are wrong by design: not for applications. Owns nothing: no tensor is
// kept, and the Work holds no state.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace commux::c10d_detail {

class NoopWork final : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    f->markCompleted();
    return f;
  }
};

class NoopBackend final : public c10d::Backend {
 public:
  using Work = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;

  NoopBackend(int rank, int size) : c10d::Backend(rank, size) {}

  const std::string getBackendName() const override { return "noop"; }

  Work broadcast(Tensors& /*t*/, const c10d::BroadcastOptions& /*o*/) override { return done(); }
  Work allreduce(Tensors& /*t*/, const c10d::AllreduceOptions& /*o*/) override { return done(); }
  Work reduce(Tensors& /*t*/, const c10d::ReduceOptions& /*o*/) override { return done(); }
  Work allgather(std::vector<Tensors>& /*out*/, Tensors& /*in*/,
                 const c10d::AllgatherOptions& /*o*/) override {
    return done();
  }
  Work _allgather_base(at::Tensor& /*out*/, at::Tensor& /*in*/,
                       const c10d::AllgatherOptions& /*o*/) override {
    return done();
  }
  Work reduce_scatter(Tensors& /*out*/, std::vector<Tensors>& /*in*/,
                      const c10d::ReduceScatterOptions& /*o*/) override {
    return done();
  }
  Work _reduce_scatter_base(at::Tensor& /*out*/, at::Tensor& /*in*/,
                            const c10d::ReduceScatterOptions& /*o*/) override {
    return done();
  }
  Work alltoall_base(at::Tensor& /*out*/, at::Tensor& /*in*/, std::vector<int64_t>& /*out_sp*/,
                     std::vector<int64_t>& /*in_sp*/, const c10d::AllToAllOptions& /*o*/) override {
    return done();
  }
  Work alltoall(Tensors& /*out*/, Tensors& /*in*/, const c10d::AllToAllOptions& /*o*/) override {
    return done();
  }
  Work send(Tensors& /*t*/, int /*dst*/, int /*tag*/) override { return done(); }
  Work recv(Tensors& /*t*/, int /*src*/, int /*tag*/) override { return done(); }
  Work recvAnysource(Tensors& /*t*/, int /*tag*/) override { return done(); }
  Work barrier(const c10d::BarrierOptions& /*o*/) override { return done(); }

 private:
  static Work done() { return c10::make_intrusive<NoopWork>(); }
};

}  // namespace commux::c10d_detail
