#pragma once

#include <pybind11/pybind11.h>

namespace rr {
void bind_engine(pybind11::module_& m);
void bind_coordination_testing(pybind11::module_& m);
void bind_gpu(pybind11::module_& m);  // gpu_bindings.cc
}  // namespace rr
