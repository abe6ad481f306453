// The pybind11 module ringreduce._core. No logic lives here: it converts
// arguments, releases the GIL around every call that can block, and maps
// rr::Error kinds to the exception classes of ringreduce.exceptions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/engine_bindings.h"
#include "bindings/rendezvous_bindings.h"
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
    // Marked as told to the other ranks (ringreduce/_refusals.py): the engine
    // reports the calls it refuses itself, and no other error is a refusal.
    py::object err = cls(e.what());
    err.attr("_ringreduce_reported") = true;
    PyErr_SetObject(cls.ptr(), err.ptr());
  }
}

void bind_context(py::module_& m) {
  using R = py::call_guard<py::gil_scoped_release>;
  py::class_<Context, std::shared_ptr<Context>>(m, "Context")
      .def(py::init([](int rank, int size, py::bytes secret, std::string host_id) {
             ContextOptions o = options_from_env(rank, size, std::string(secret));
             o.host_id = std::move(host_id);
             return std::make_shared<Context>(std::move(o));
           }),
           py::arg("rank"), py::arg("size"), py::arg("secret"), py::arg("host_id"))
      .def("local_info", [](const Context& c) { return py::bytes(c.local_info()); })
      .def("connect",
           [](Context& c, const std::vector<std::string>& infos) {
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
      .def_property_readonly("hosts", &Context::hosts)
      .def("transport_to", [](Context& c, int peer) { return std::string(c.link(peer).kind()); });
}

}  // namespace
}  // namespace rr

PYBIND11_MODULE(_core, m) {
  m.doc() = "ringreduce C++ core: transports, ring collectives";
  py::register_exception_translator(&rr::translate);
  m.def("reduce_isa", &rr::reduce_isa);
  rr::bind_context(m);
  rr::bind_rendezvous(m);
  rr::bind_engine(m);
  rr::bind_coordination_testing(m);
  rr::bind_gpu(m);
}
