// The one file that includes pybind11 (torch's own copy, so torch's Store and Backend types cast
// across). Exposes ProcessGroupUCX as a subclass of torch's c10d Backend, plus runtime facts for
// `python -m commux.info`.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <thread>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "commux/process_group_ucx.hpp"
#include "commux/transports.hpp"
#include "../c10d/ep_kernels.hpp"
#include "../c10d/noop_backend.hpp"
#include "../c10d/work.hpp"

namespace py = pybind11;

namespace {

py::dict runtime_info() {
  const commux::Options o = commux::Options::from_env();
  commux::RuntimeInfo i;
  {
    py::gil_scoped_release nogil;
    i = commux::probe_runtime(o);
  }
  py::dict d;
  d["ucx_version"] = i.ucx_version;
  d["transports"] = i.transports;
  d["memory_types"] = i.memory_types;
  d["applied_defaults"] = i.applied_defaults;
  d["user_settings"] = i.user_settings;
  d["event_fd"] = i.event_fd;
  d["packing"] = o.packing == commux::Packing::kIov ? "iov (COMMUX_COALESCE)" : "parts";
  d["coalescing_window"] =
      o.defer_in_window ? "deferred, posted together (COMMUX_GROUP)" : "posted at once";
  d["spin_us"] = o.spin.count();
  d["shutdown_timeout_ms"] = o.shutdown_timeout.count();
  return d;
}

// Ctrl-C (src/c10d/work.hpp): a wait blocked in the backend on Python's main thread checks for
// a pending signal every 100 ms; PyErr_CheckSignals runs the Python handler, and the exception it
// raises (KeyboardInterrupt) leaves as error_already_set, which the pybind11 binding that called
// into the backend (torch's Work.wait) restores in Python.
std::thread::id g_python_main_thread;

bool on_python_main_thread() {
  return std::this_thread::get_id() == g_python_main_thread && Py_IsInitialized() != 0;
}

void check_python_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

commux::Accelerator parse_accelerator(const std::string& a) {
  if (a == "none" || a == "cpu") return commux::Accelerator::kNone;
  if (a == "cuda") return commux::Accelerator::kCuda;
  if (a == "rocm") return commux::Accelerator::kRocm;
  if (a == "xpu") return commux::Accelerator::kXpu;
  return commux::Accelerator::kUnknown;
}

py::dict choose_transports(const std::string& accelerator,
                           const std::vector<std::string>& available,
                           const std::optional<std::string>& user_tls) {
  const auto c = commux::choose_transports(parse_accelerator(accelerator), available,
                                           user_tls ? user_tls->c_str() : nullptr, accelerator);
  py::dict d;
  d["accelerator"] = commux::accelerator_name(c.accelerator);
  d["transports"] = c.transports;
  d["copy_transport"] = c.copy_transport;
  d["copy_available"] = c.copy_available;
  d["copy_allowed"] = c.copy_allowed;
  d["warnings"] = c.warnings;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "commux: the UCX backend for torch.distributed (native part)";
  py::module_::import("torch.distributed");  // registers c10d's Backend and Store types
  {
    py::module_ threading = py::module_::import("threading");
    if (threading.attr("current_thread")().is(threading.attr("main_thread")())) {
      g_python_main_thread = std::this_thread::get_id();
      commux::c10d_detail::set_interrupt_hook({&on_python_main_thread, &check_python_signals});
    }
  }

  // The benchmark's reference for torch's own cost per call (src/c10d/noop_backend.hpp).
  using commux::c10d_detail::NoopBackend;
  py::class_<NoopBackend, c10d::Backend, c10::intrusive_ptr<NoopBackend>>(m, "_NoopBackend")
      .def(py::init(
               [](int rank, int size) { return c10::make_intrusive<NoopBackend>(rank, size); }),
           py::arg("rank"), py::arg("size"));

  py::class_<commux::ProcessGroupUCX, c10d::Backend, c10::intrusive_ptr<commux::ProcessGroupUCX>>(
      m, "ProcessGroupUCX")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& name,
                       const std::string& group_name) {
             return c10::make_intrusive<commux::ProcessGroupUCX>(store, rank, size, timeout, name,
                                                                 group_name);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout") = commux::ProcessGroupUCX::kDefaultTimeout, py::arg("name") = "ucx",
           py::arg("group_name") = "", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("timeout", &commux::ProcessGroupUCX::timeout)
      .def(
          "_exchange_lanes",
          [](commux::ProcessGroupUCX& pg, const std::string& op,
             const std::vector<at::Tensor>& sends,
             const std::vector<std::vector<std::int64_t>>& send_bytes,
             const std::vector<at::Tensor>& recvs,
             const std::vector<std::vector<std::int64_t>>& recv_offsets,
             const std::vector<std::vector<std::int64_t>>& recv_capacity, std::int64_t timeout_ms) {
            return pg.exchange_lanes(op, sends, send_bytes, recvs, recv_offsets, recv_capacity,
                                     std::chrono::milliseconds(timeout_ms));
          },
          py::arg("op"), py::arg("sends"), py::arg("send_bytes"), py::arg("recvs"),
          py::arg("recv_offsets"), py::arg("recv_capacity"), py::arg("timeout_ms") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "commux.ep's sparse all-to-all of byte tensors on internal tags (see "
          "process_group_ucx.hpp)")
      .def(
          "_ep_header_step",
          [](commux::ProcessGroupUCX& pg, const std::string& op,
             const std::vector<std::int64_t>& fields, const std::string& reason,
             std::int64_t header_ints, std::int64_t rows_at, std::int64_t bytes_at,
             const std::vector<std::int64_t>& counts, std::int64_t stride,
             std::int64_t timeout_ms) {
            // commux.ep's first step in one call: every rank's header out (make_headers), every
            // rank's header in, read back (read_headers). Returns (fields, reasons, bytes received).
            commux::ep::Headers h;
            std::vector<std::int64_t> got;
            {
              py::gil_scoped_release nogil;
              const auto R = static_cast<std::int64_t>(counts.size());
              const std::int64_t hb = header_ints * 8;
              at::Tensor out = commux::ep::make_headers(fields, reason, header_ints, rows_at,
                                                        bytes_at, counts, stride)
                                   .view({-1});
              at::Tensor in = at::empty({R * hb}, out.options());
              std::vector<std::int64_t> sizes(static_cast<std::size_t>(R), hb), offsets;
              for (std::int64_t p = 0; p < R; ++p) offsets.push_back(p * hb);
              got = pg.exchange_lanes(op, {out}, {sizes}, {in}, {offsets}, {sizes},
                                      std::chrono::milliseconds(timeout_ms));
              h = commux::ep::read_headers(in, offsets, got, hb,
                                           static_cast<std::int64_t>(fields.size()));
            }
            py::list reasons;
            for (const auto& r : h.reasons) reasons.append(py::bytes(r));
            return py::make_tuple(h.fields, reasons, got);
          },
          py::arg("op"), py::arg("fields"), py::arg("reason"), py::arg("header_ints"),
          py::arg("rows_at"), py::arg("bytes_at"), py::arg("counts"), py::arg("stride"),
          py::arg("timeout_ms") = 0)
      .def_property_readonly("device_ops_calls", &commux::ProcessGroupUCX::device_ops_calls,
                             "collective calls that reduced and kept scratch on the tensors' "
                             "device through ATen (device tensors; CPU with COMMUX_ATEN_REDUCE=1)")
      .def_property_readonly("caller_ran_calls", &commux::ProcessGroupUCX::caller_ran_calls,
                             "collectives run on the thread that issued or waited for them "
                             "(COMMUX_CALLER_RUNS), not on the group's collective thread")
      .def_property_readonly("concurrent_calls", &commux::ProcessGroupUCX::concurrent_calls,
                             "collectives that started while another collective of the group "
                             "was running (COMMUX_INFLIGHT)")
      .def_property_readonly("scheduled_calls", &commux::ProcessGroupUCX::scheduled_calls,
                             "collectives started as schedules (COMMUX_SCHEDULE): resumed by "
                             "whichever thread waits, holding no thread while they wait")
      .def_property_readonly("inflight", &commux::ProcessGroupUCX::inflight,
                             "how many collectives of the group may run at once (COMMUX_INFLIGHT, "
                             "auto resolved)");

  // The package's exit hook (python/commux/__init__.py): future completions on commux's threads
  // stop, and those under way finish, before the interpreter finalizes (work.hpp).
  m.def(
      "_quiesce_callbacks",
      [](double timeout_s) {
        py::gil_scoped_release nogil;  // a callback under way may need the GIL to finish
        return commux::c10d_detail::quiesce_callbacks(
            std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
      },
      py::arg("timeout_s"));

  // commux.ep's row work (src/c10d/ep_kernels.hpp).
  m.def(
      "_ep_route",
      [](const at::Tensor& topk_idx, std::int64_t num_experts, std::int64_t ranks,
         bool per_assignment) {
        commux::ep::Route r;
        {
          py::gil_scoped_release nogil;
          r = commux::ep::route(topk_idx, num_experts, ranks, per_assignment);
        }
        return py::make_tuple(r.error, r.counts, r.token, r.slot, r.expert, r.in_rank,
                              r.per_expert);
      },
      py::arg("topk_idx"), py::arg("num_experts"), py::arg("ranks"), py::arg("per_assignment"));
  m.def(
      "_ep_pack",
      [](const std::vector<at::Tensor>& parts, const std::vector<std::int64_t>& offsets,
         const std::optional<at::Tensor>& index, const std::vector<at::Tensor>& row_parts,
         const std::vector<std::int64_t>& row_offsets, const std::vector<std::int64_t>& counts,
         std::int64_t stride) {
        return commux::ep::pack(parts, offsets, index ? *index : at::Tensor(), row_parts,
                                row_offsets, counts, stride);
      },
      py::arg("parts"), py::arg("offsets"), py::arg("index"), py::arg("row_parts"),
      py::arg("row_offsets"), py::arg("counts"), py::arg("stride"),
      py::call_guard<py::gil_scoped_release>());
  m.def("_ep_set_aten_on_host", &commux::ep::set_aten_on_host, py::arg("on"));
  m.def("_ep_make_headers", &commux::ep::make_headers, py::arg("fields"), py::arg("reason"),
        py::arg("header_ints"), py::arg("rows_at"), py::arg("bytes_at"), py::arg("counts"),
        py::arg("stride"));
  m.def(
      "_ep_read_headers",
      [](const at::Tensor& recv, const std::vector<std::int64_t>& slot_offsets,
         const std::vector<std::int64_t>& received, std::int64_t header_bytes,
         std::int64_t fields) {
        auto h = commux::ep::read_headers(recv, slot_offsets, received, header_bytes, fields);
        py::list reasons;
        for (const auto& r : h.reasons) reasons.append(py::bytes(r));
        return py::make_tuple(h.fields, reasons);
      },
      py::arg("recv"), py::arg("slot_offsets"), py::arg("received"), py::arg("header_bytes"),
      py::arg("fields"));
  m.def("_ep_unpack", &commux::ep::unpack, py::arg("recv"), py::arg("slot_offsets"),
        py::arg("rows"), py::arg("stride"), py::arg("offsets"), py::arg("sizes"),
        py::call_guard<py::gil_scoped_release>());

  m.def(
      "_ep_local_ids",
      [](const at::Tensor& gid, const std::optional<at::Tensor>& weights, std::int64_t lo,
         std::int64_t experts_here, std::int64_t alignment) {
        auto r = commux::ep::local_ids(gid, weights ? *weights : at::Tensor(), lo, experts_here,
                                       alignment);
        return py::make_tuple(r.local, r.per_expert);
      },
      py::arg("gid"), py::arg("weights"), py::arg("lo"), py::arg("experts_here"),
      py::arg("alignment"));
  m.def(
      "_ep_combine_sum",
      [](const at::Tensor& x, const std::optional<at::Tensor>& weights, const at::Tensor& order,
         std::int64_t tokens) {
        std::vector<at::Tensor> r;
        {
          py::gil_scoped_release nogil;
          r = commux::ep::combine_sum(x, weights ? *weights : at::Tensor(), order, tokens);
        }
        return py::make_tuple(r[0], r[1]);
      },
      py::arg("x"), py::arg("weights"), py::arg("order"), py::arg("tokens"));

  m.def(
      "_ep_ll_place",
      [](const std::vector<at::Tensor>& rows, const at::Tensor& expert, const at::Tensor& src,
         const std::vector<std::int64_t>& recv_counts, std::int64_t lo, std::int64_t experts_here,
         std::int64_t slots) {
        commux::ep::Placed r;
        {
          py::gil_scoped_release nogil;
          r = commux::ep::ll_place(rows, expert, src, recv_counts, lo, experts_here, slots);
        }
        return py::make_tuple(r.rows, r.src_info, r.count, r.layout_range, r.gather);
      },
      py::arg("rows"), py::arg("expert"), py::arg("src"), py::arg("recv_counts"), py::arg("lo"),
      py::arg("experts_here"), py::arg("slots"));

  // Settings (commux/settings.hpp): the table, and the values this process read at first use.
  m.def(
      "settings_table",
      [] {
        py::list rows;
        for (const commux::Setting& s : commux::settings_table()) {
          py::dict d;
          d["name"] = s.name;
          d["type"] = s.type;
          d["default"] = s.default_value;
          d["read"] = s.per_communicator ? "per group" : "once";
          d["meaning"] = s.meaning;
          rows.append(d);
        }
        return rows;
      },
      "Every environment variable commux reads: name, type, default, read (per group or once), "
      "meaning");
  m.def(
      "settings",
      [] {
        py::dict out;
        for (const auto& v : commux::settings().values) {
          const std::string type = v.setting->type;
          py::dict d;
          d["text"] = v.text;
          d["source"] = v.from_env ? "environment" : "default";
          if (type == "bool") {
            d["value"] = v.text == "1" || v.text == "on" || v.text == "true" || v.text == "yes";
          } else if (type == "int") {
            d["value"] = std::stol(v.text);  // checked by the parser
          } else {
            d["value"] = v.text;
          }
          out[v.setting->name] = d;
        }
        return out;
      },
      "{name: {value, text, source}} for every setting, as parsed at first use in this process; "
      "raises RuntimeError naming a variable whose value does not parse");

  m.def("choose_transports", &choose_transports, py::arg("accelerator"), py::arg("available"),
        py::arg("user_tls") = py::none(),
        "The UCX transports for an accelerator ('cuda', 'rocm', 'xpu', 'none' or another device "
        "type), from the transports UCX has and the user's UCX_TLS (None when unset).");
  m.def("available_transports", &commux::ucx_available_transports,
        py::call_guard<py::gil_scoped_release>(),
        "Transports the local UCX has, whatever UCX_TLS says.");
  m.def("runtime_info", &runtime_info,
        "UCX version, transports, memory types and the settings commux applies in this process");
#ifdef COMMUX_VERSION
  m.attr("__version__") = COMMUX_VERSION;
#endif
}
