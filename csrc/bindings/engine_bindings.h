#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "coordination/handle.h"
#include "coordination/request.h"

namespace rr {
// The handle of a per-gradient hot path (an in-place allreduce of a numpy array,
// engine_bindings.cc, or of a GPU tensor a framework layer described,
// gpu_engine_bindings.cc): wait() returns `array` itself. It holds the arrays,
// so the Python side keeps the buffers alive for as long as it keeps the handle
// (the Communicator keeps every handle until it is done). Python's Handle
// (ringreduce/_handles.py) does the same for every other call; this one skips
// its Python frames, a few microseconds per gradient.
struct ArrayHandle {
  std::shared_ptr<HandleState> state;
  pybind11::object array;  // what wait() returns: the array, or the new result
  pybind11::object input;  // out of place: the input, read until the collective is done
};

void bind_engine(pybind11::module_& m);
void bind_coordination_testing(pybind11::module_& m);
void bind_gpu(pybind11::module_& m);          // gpu_bindings.cc
void bind_gpu_testing(pybind11::module_& m);  // gpu_testing_bindings.cc, under bind_gpu's module
void bind_gpu_engine(pybind11::module_& m);   // gpu_engine_bindings.cc, under bind_gpu's module
// A test's tensor dict (name, kind, dtype, op, root, shape, prescale,
// postscale, group, device) as metadata; coordination_testing_bindings.cc.
RequestMeta request_meta_from(const pybind11::dict& d);
}  // namespace rr
