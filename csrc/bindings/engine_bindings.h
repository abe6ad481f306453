#pragma once

#include <pybind11/pybind11.h>

#include "coordination/request.h"

namespace rr {
void bind_engine(pybind11::module_& m);
void bind_coordination_testing(pybind11::module_& m);
void bind_gpu(pybind11::module_& m);          // gpu_bindings.cc
void bind_gpu_testing(pybind11::module_& m);  // gpu_testing_bindings.cc, under bind_gpu's module
void bind_gpu_engine(pybind11::module_& m);   // gpu_engine_bindings.cc, under bind_gpu's module
// A test's tensor dict (name, kind, dtype, op, root, shape, prescale,
// postscale, group, device) as metadata; coordination_testing_bindings.cc.
RequestMeta request_meta_from(const pybind11::dict& d);
}  // namespace rr
