// The pybind11 module ringreduce._core. No logic lives here: it converts
// arguments, releases the GIL around every call that can block, and maps
// rr::Error kinds to the exception classes of ringreduce.exceptions.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/rendezvous_bindings.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"
#include "common/error.h"
#include "transport/context.h"

namespace py = pybind11;

namespace rr {
namespace {

const char* exception_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kInvalidArgument: return "InvalidInputError";
    case ErrorKind::kMismatch: return "MismatchError";
    case ErrorKind::kPeerLost: return "PeerLostError";
    case ErrorKind::kTimeout: return "RingReduceTimeoutError";
    case ErrorKind::kInternal: return "RingReduceError";
  }
  return "RingReduceError";
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    // The classes live in Python so they can also derive from ValueError etc.
    py::object cls = py::module_::import("ringreduce.exceptions").attr(exception_name(e.kind()));
    PyErr_SetString(cls.ptr(), e.what());
  }
}

// Buffers arrive as numpy arrays (read straight from the array struct: far
// cheaper than arr.ctypes.data) or as plain integer addresses (torch's
// data_ptr(), DLPack producers).
uintptr_t address_of(py::handle obj) {
  if (py::isinstance<py::array>(obj))
    return reinterpret_cast<uintptr_t>(py::reinterpret_borrow<py::array>(obj).data());
  return obj.cast<uintptr_t>();
}

Tensor tensor_arg(py::handle buf, std::vector<int64_t> shape, int32_t dtype, std::string name) {
  if (!dtype_is_valid(dtype))
    throw_error(ErrorKind::kInvalidArgument, "unknown dtype code ", dtype);
  return Tensor{reinterpret_cast<const void*>(address_of(buf)), std::move(shape), static_cast<DType>(dtype),
                std::move(name)};
}

ReduceOp op_arg(int32_t op) {
  if (!reduce_op_is_valid(op)) throw_error(ErrorKind::kInvalidArgument, "unknown op code ", op);
  return static_cast<ReduceOp>(op);
}

// Wraps a Python callable shape -> int (address) as an Allocator; it runs on
// the communicating thread, so it takes the GIL for the call.
Allocator py_allocator(py::function fn) {
  return [fn](const std::vector<int64_t>& shape) -> void* {
    py::gil_scoped_acquire gil;
    return reinterpret_cast<void*>(fn(shape).cast<uintptr_t>());
  };
}

void bind_context(py::module_& m) {
  using R = py::call_guard<py::gil_scoped_release>;
  py::class_<Context>(m, "Context")
      .def(py::init([](int rank, int size, py::bytes secret, std::string host_id) {
             ContextOptions o = options_from_env(rank, size, std::string(secret));
             o.host_id = std::move(host_id);
             return std::make_unique<Context>(std::move(o));
           }),
           py::arg("rank"), py::arg("size"), py::arg("secret"), py::arg("host_id"))
      .def("local_info", [](const Context& c) { return py::bytes(c.local_info()); })
      .def("connect", [](Context& c, const std::vector<std::string>& infos) {
             py::gil_scoped_release nogil;
             c.connect(infos);
           })
      .def("close", &Context::close, R())
      .def_property_readonly("rank", &Context::rank)
      .def_property_readonly("size", &Context::size)
      .def_property_readonly("local_rank", &Context::local_rank)
      .def_property_readonly("local_size", &Context::local_size)
      .def_property_readonly("cross_rank", &Context::cross_rank)
      .def_property_readonly("cross_size", &Context::cross_size)
      .def("transport_to", [](Context& c, int peer) { return std::string(c.link(peer).kind()); })
      .def("allreduce",
           [](Context& c, py::handle in, py::handle out, std::vector<int64_t> shape, int32_t dtype,
              int32_t op, double pre, double post, std::string name) {
             Tensor t = tensor_arg(in, std::move(shape), dtype, std::move(name));
             void* dst = reinterpret_cast<void*>(address_of(out));
             py::gil_scoped_release nogil;
             allreduce(c, t, dst, op_arg(op), pre, post);
           })
      .def("allgather",
           [](Context& c, py::handle in, std::vector<int64_t> shape, int32_t dtype, std::string name,
              py::function alloc) {
             Tensor t = tensor_arg(in, std::move(shape), dtype, std::move(name));
             Allocator a = py_allocator(std::move(alloc));
             py::gil_scoped_release nogil;
             allgather(c, t, a);
           })
      .def("broadcast",
           [](Context& c, py::handle buf, std::vector<int64_t> shape, int32_t dtype, int root,
              std::string name) {
             Tensor t = tensor_arg(buf, std::move(shape), dtype, std::move(name));
             py::gil_scoped_release nogil;
             broadcast(c, const_cast<void*>(t.data), t, root);
           })
      .def("reducescatter",
           [](Context& c, py::handle in, std::vector<int64_t> shape, int32_t dtype, int32_t op,
              double pre, double post, std::string name, py::function alloc) {
             Tensor t = tensor_arg(in, std::move(shape), dtype, std::move(name));
             Allocator a = py_allocator(std::move(alloc));
             py::gil_scoped_release nogil;
             reducescatter(c, t, op_arg(op), pre, post, a);
           })
      .def("alltoall",
           [](Context& c, py::handle in, std::vector<int64_t> shape, int32_t dtype,
              std::vector<int64_t> splits, std::string name, py::function alloc) {
             Tensor t = tensor_arg(in, std::move(shape), dtype, std::move(name));
             Allocator a = py_allocator(std::move(alloc));
             py::gil_scoped_release nogil;
             return alltoall(c, t, splits, a);
           })
      .def("barrier", [](Context& c, std::string name) {
             py::gil_scoped_release nogil;
             barrier(c, name);
           });
}

}  // namespace
}  // namespace rr

PYBIND11_MODULE(_core, m) {
  m.doc() = "ringreduce C++ core: transports, ring collectives";
  py::register_exception_translator(&rr::translate);
  m.def("reduce_isa", &rr::reduce_isa);
  rr::bind_context(m);
  rr::bind_rendezvous(m);
}
