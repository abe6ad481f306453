// Python bindings for the rendezvous stores and the HMAC helper; the main
// module calls bind_rendezvous() from its PYBIND11_MODULE.
#pragma once

#include <pybind11/pybind11.h>

namespace rr {

void bind_rendezvous(pybind11::module_& m);

}  // namespace rr
