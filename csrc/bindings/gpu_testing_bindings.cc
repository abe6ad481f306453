// Unit-test access to the GPU executor without a GPU (submodule
// ringreduce._core.gpu.testing): GpuExecutor driven over FakeGpuOps, whose
// call log the tests compare, and an Engine given fake GPU executors. Device
// addresses are plain integers here: nothing is ever dereferenced.
#include <pybind11/stl.h>

#include <deque>
#include <map>

#include "bindings/engine_bindings.h"
#include "coordination/engine.h"
#include "gpu/fake_gpu_ops.h"
#include "gpu/gpu_bootstrap.h"
#include "gpu/gpu_executor.h"

namespace py = pybind11;

namespace rr {
namespace {

using gpu::EventState;
using gpu::FakeGpuOps;
using gpu::GpuExecutor;

void* as_ptr(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return nullptr;
  return reinterpret_cast<void*>(static_cast<uintptr_t>(d[key].cast<uint64_t>()));
}

// One tensor of a test response: the metadata keys of request_meta_from, and
// "in" / "out" device addresses ("in": None: this rank joined and lacks it),
// "stream" / "event" (the producer's, as numbers), "splits" / "peer_rows"
// (allgather / alltoall).
Entry entry_from(const py::dict& d, int32_t device) {
  Entry e;
  e.meta = request_meta_from(d);
  e.meta.device = device;
  e.in = as_ptr(d, "in");
  e.out = d.contains("out") ? as_ptr(d, "out") : const_cast<void*>(e.in);
  e.gpu_stream = as_ptr(d, "stream");
  e.gpu_ready_event = as_ptr(d, "event");
  if (d.contains("splits")) e.splits = d["splits"].cast<std::vector<int64_t>>();
  if (d.contains("peer_rows")) e.peer_rows = d["peer_rows"].cast<std::vector<int64_t>>();
  return e;
}

py::list completions(std::vector<Completion> cs) {
  py::list out;
  for (Completion& c : cs) {
    py::dict d;
    d["names"] = c.names;
    d["ok"] = c.ok;
    d["message"] = c.message;
    out.append(d);
  }
  return out;
}

// A GpuExecutor plus the entries it was given (kept alive while in flight).
struct ExecutorUnderTest {
  std::shared_ptr<FakeGpuOps> ops;
  std::unique_ptr<GpuExecutor> ex;
  std::deque<Entry> entries;
  int size;
};

EventState state_from(const std::string& s) {
  if (s == "pending") return EventState::kPending;
  if (s == "done") return EventState::kDone;
  if (s == "error") return EventState::kError;
  throw_error(ErrorKind::kInvalidArgument, "event state must be pending, done or error: ", s);
}

}  // namespace

void bind_gpu_testing(py::module_& parent) {
  py::module_ m = parent.def_submodule("testing", "the GPU executor over a recording fake");
  py::class_<FakeGpuOps, std::shared_ptr<FakeGpuOps>>(m, "FakeGpuOps")
      .def(py::init<int, uint8_t>(), py::arg("nccl_version") = 22703, py::arg("id_seed") = 0)
      .def("calls", &FakeGpuOps::calls)
      .def("clear_calls", &FakeGpuOps::clear_calls)
      .def("complete_all", &FakeGpuOps::complete_all, py::arg("sticky") = false)
      .def(
          "set_event",
          [](FakeGpuOps& f, uint64_t id, const std::string& state, const std::string& error) {
            f.set_event(id, state_from(state), error);
          },
          py::arg("id"), py::arg("state"), py::arg("error") = "")
      .def("set_async_error", &FakeGpuOps::set_async_error)
      .def("set_abort_drains", &FakeGpuOps::set_abort_drains)
      .def("fail_next", &FakeGpuOps::fail_next)
      .def("syncs", &FakeGpuOps::syncs)
      .def("defer_rings", &FakeGpuOps::defer_rings)
      .def("ring_late", &FakeGpuOps::ring_late);

  py::class_<ExecutorUnderTest>(m, "GpuExecutor")
      .def(py::init([](std::shared_ptr<FakeGpuOps> ops, int device, int rank, int size,
                       uint64_t chunk_bytes, double drain_seconds) {
             gpu::GpuExecutorOptions o;
             o.device = device;
             o.rank = rank;
             o.size = size;
             o.pack.chunk_bytes = chunk_bytes;
             o.drain_seconds = drain_seconds;
             auto t = std::make_unique<ExecutorUnderTest>();
             t->ops = ops;
             t->ex = std::make_unique<GpuExecutor>(ops, o);
             t->size = size;
             return t;
           }),
           py::arg("ops"), py::arg("device") = 0, py::arg("rank") = 0, py::arg("size") = 2,
           py::arg("chunk_bytes") = 0, py::arg("drain_seconds") = 10.0)
      .def("init_comm",
           [](ExecutorUnderTest& t, py::bytes id) { t.ex->init_comm(std::string(id)); })
      // One response of `tensors` (dicts, see entry_from); returns execute()'s answer.
      .def(
          "execute",
          [](ExecutorUnderTest& t, const std::vector<py::dict>& tensors, int contributors) {
            Response r;
            r.contributors = contributors > 0 ? contributors : t.size;
            std::vector<Entry*> local;
            for (const py::dict& d : tensors) {
              Entry e = entry_from(d, 0);
              r.tensors.push_back(e.meta);
              if (!d.contains("in") || d["in"].is_none()) {
                local.push_back(nullptr);
                continue;
              }
              t.entries.push_back(std::move(e));
              local.push_back(&t.entries.back());
            }
            return t.ex->execute(r, local);
          },
          py::arg("tensors"), py::arg("contributors") = 0)
      .def("poll", [](ExecutorUnderTest& t) { return completions(t.ex->poll()); })
      .def_property_readonly("busy", [](const ExecutorUnderTest& t) { return t.ex->busy(); })
      .def("close", [](ExecutorUnderTest& t) { t.ex.reset(); });

  // GPU `device` of `engine` gets a GpuExecutor over ops[device] (a fake).
  // Without `bootstrap` its communicator is joined at once; with it, through
  // the real bootstrap over the engine's Context (gpu_bootstrap.h), where a
  // device without a fake is a GPU this rank cannot use.
  m.def(
      "use_fake_gpus",
      [](Engine& eng, std::map<int, std::shared_ptr<FakeGpuOps>> ops, bool bootstrap) {
        Context& ctx = eng.context();
        eng.set_device_executor_factory([ops, &ctx, bootstrap](int32_t device) {
          auto it = ops.find(device);
          if (bootstrap) {
            std::shared_ptr<FakeGpuOps> fake = it == ops.end() ? nullptr : it->second;
            return gpu::bootstrap_gpu_executor(
                ctx, device, fake, fake ? std::string() : cat("no fake for GPU ", device),
                [fake](Context&) { return fake; });  // a set's calls in the same log
          }
          if (it == ops.end()) throw_error(ErrorKind::kInvalidArgument, "no fake for GPU ", device);
          gpu::GpuExecutorOptions o;
          o.device = device;
          o.rank = ctx.rank();
          o.size = ctx.size();
          auto ex = std::make_unique<GpuExecutor>(it->second, o);
          ex->init_comm(std::string(128, '\0'));
          return std::unique_ptr<Executor>(std::move(ex));
        });
      },
      py::arg("engine"), py::arg("ops"), py::arg("bootstrap") = false);
  // The idle engine thread's longest sleep while GPU work is in flight.
  m.def("set_device_poll",
        [](Engine& eng, double seconds) { eng.set_device_poll_seconds(seconds); });
  // Submits one tensor (a dict as for GpuExecutor.execute) on `device`.
  m.def("submit", [](Engine& eng, const py::dict& tensor, int32_t device) {
    std::vector<Entry> v;
    v.push_back(entry_from(tensor, device));
    py::gil_scoped_release nogil;
    return eng.submit(std::move(v));
  });
}

}  // namespace rr
