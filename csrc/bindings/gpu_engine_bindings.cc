// GPU tensors into the Engine (ringreduce/_cuda_arrays.py finds their device
// addresses, streams and dtypes), and the emulated GPUs tests select with
// RINGREDUCE_GPU_EMULATE=1. No logic: argument conversion only.
#include <pybind11/stl.h>

#include "bindings/engine_bindings.h"
#include "coordination/engine.h"
#include "gpu/emulated_gpu_ops.h"
#include "gpu/gpu_bootstrap.h"

namespace py = pybind11;

namespace rr {
namespace {

void* as_ptr(uint64_t a) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(a));
}

// One entry per element of `ins`, all on `device`, produced on `stream`
// (0: the legacy default stream); outs[i] == 0: in place. Several entries
// with a `group` run as one fused unit (grouped_allreduce). Allgather and
// alltoall: `peer_rows` are the rows coming from each rank (and `splits`
// alltoall's rows going to each). `members`: a process set's ranks (empty: the job).
// `wire`: an allreduce's compression, the dtype it travels as (-1: none).
std::shared_ptr<HandleState> submit_gpu(Engine& eng, int32_t kind, const std::vector<uint64_t>& ins,
                                        const std::vector<uint64_t>& outs,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        int32_t dtype, const std::vector<std::string>& names,
                                        const std::string& group, int32_t device, uint64_t stream,
                                        int32_t op, double pre, double post, int32_t root,
                                        const std::vector<int64_t>& splits,
                                        const std::vector<int64_t>& peer_rows,
                                        const std::vector<int32_t>& members, int32_t wire) {
  if (kind < 1 || kind > static_cast<int32_t>(CollKind::kAlltoall))
    throw_error(ErrorKind::kInvalidArgument, "unknown collective code ", kind);
  if (!dtype_is_valid(dtype)) throw_error(ErrorKind::kInvalidArgument, "unknown dtype ", dtype);
  if (!reduce_op_is_valid(op)) throw_error(ErrorKind::kInvalidArgument, "unknown op ", op);
  if (wire != -1 && !dtype_is_valid(wire))
    throw_error(ErrorKind::kInvalidArgument, "unknown wire dtype ", wire);
  if (outs.size() != ins.size() || shapes.size() != ins.size() || names.size() != ins.size())
    throw_error(ErrorKind::kInvalidArgument,
                "submit_gpu: ins, outs, shapes, names differ in length");
  std::vector<Entry> es(ins.size());
  for (size_t i = 0; i < ins.size(); ++i) {
    Entry& e = es[i];
    e.meta.kind = static_cast<CollKind>(kind);
    e.meta.dtype = static_cast<DType>(dtype);
    e.meta.op = static_cast<ReduceOp>(op);
    e.meta.prescale = pre;
    e.meta.postscale = post;
    e.meta.root = root;
    e.meta.device = device;
    e.meta.shape = shapes[i];
    e.meta.name = names[i];
    e.meta.group = group;
    e.in = as_ptr(ins[i]);
    e.out = as_ptr(outs[i] ? outs[i] : ins[i]);
    e.gpu_stream = as_ptr(stream);
    e.splits = splits;
    e.peer_rows = peer_rows;
    e.meta.members = members;
    e.meta.wire = wire;
  }
  py::gil_scoped_release nogil;  // submit may wait for the engine's queue lock
  return eng.submit(std::move(es));
}

// The per-gradient hot path of a framework layer (DistributedOptimizer's hooks on
// CUDA): one in-place allreduce of GPU tensor `obj`, which the layer has already
// described (address, shape, dtype code, device, producing stream) at a few
// attribute reads. The handle keeps `obj` alive and its wait() returns it.
ArrayHandle allreduce_gpu_(Engine& eng, py::object obj, uint64_t ptr, std::vector<int64_t> shape,
                           int32_t dtype, std::string name, int32_t device, uint64_t stream,
                           int32_t op, double pre, double post, const std::vector<int32_t>& members,
                           int32_t wire) {
  std::shared_ptr<HandleState> state = submit_gpu(
      eng, static_cast<int32_t>(CollKind::kAllreduce), {ptr}, {0}, {std::move(shape)}, dtype,
      {std::move(name)}, "", device, stream, op, pre, post, -1, {}, {}, members, wire);
  return ArrayHandle{std::move(state), obj, obj};
}

// A stream-ordered wait (HandleState::mark_enqueued): once the handle's GPU
// work is enqueued, `stream` (a framework's, 0: the legacy default stream)
// is made to wait for it, without waiting for the device; returns the stream
// the work runs on. A handle already done returns None (or raises) as wait()
// would. A failure after that is the engine's: the next call raises it.
py::object wait_stream(HandleState& s, uint64_t stream) {
  constexpr int64_t kSignalCheckNs = 100'000'000;  // Ctrl-C ends a wait for a peer
  for (;;) {
    bool ready;
    {
      py::gil_scoped_release nogil;
      ready = s.wait_enqueued_for(kSignalCheckNs);
    }
    if (ready) break;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
  HandleState::StreamWaiter waiter = s.done() ? nullptr : s.stream_waiter();
  if (!waiter) {
    s.rethrow();
    return py::none();
  }
  waiter(as_ptr(stream));
  return py::int_(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s.executor_stream())));
}

}  // namespace

void bind_gpu_engine(py::module_& m) {
  m.def("submit", &submit_gpu, py::arg("engine"), py::arg("kind"), py::arg("ins"), py::arg("outs"),
        py::arg("shapes"), py::arg("dtype"), py::arg("names"), py::arg("group"), py::arg("device"),
        py::arg("stream"), py::arg("op") = 0, py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
        py::arg("root") = -1, py::arg("splits") = std::vector<int64_t>{},
        py::arg("peer_rows") = std::vector<int64_t>{}, py::arg("members") = std::vector<int32_t>{},
        py::arg("wire") = -1);
  m.def("allreduce_", &allreduce_gpu_, py::arg("engine"), py::arg("obj"), py::arg("ptr"),
        py::arg("shape"), py::arg("dtype"), py::arg("name"), py::arg("device"), py::arg("stream"),
        py::arg("op"), py::arg("pre"), py::arg("post"), py::arg("members"), py::arg("wire"));
  m.def(
      "wait_stream", [](ArrayHandle& h, uint64_t stream) { return wait_stream(*h.state, stream); },
      py::arg("handle"), py::arg("stream"));
  m.def("wait_stream", &wait_stream, py::arg("handle"), py::arg("stream"));
  // Testing aid: this engine's GPUs become emulated ones (emulated_gpu_ops.h),
  // their communicator bootstrapped like a real one.
  m.def(
      "use_emulated_gpus",
      [](Engine& eng, int nccl_version) {
        Context& ctx = eng.context();
        eng.set_device_executor_factory([&ctx, nccl_version](int32_t device) {
          return gpu::bootstrap_gpu_executor(
              ctx, device, gpu::make_emulated_gpu_ops(ctx, nccl_version), "",
              [nccl_version](Context& group) {
                return gpu::make_emulated_gpu_ops(group, nccl_version);
              });
        });
      },
      py::arg("engine"), py::arg("nccl_version") = 22703);
}

}  // namespace rr
