// Submodule ringreduce._core.gpu: what the build and this machine offer for
// GPU arrays, the NCCL loader, and test access to the kernels' planning and
// CPU reference. The registration point of csrc/gpu/: the only file outside
// it that tests RR_HAVE_CUDA (setup.py defines it 0 or 1, never leaves it out).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/engine_bindings.h"
#include "common/error.h"
#include "coordination/executor.h"
#include "gpu/kernels_reference.h"
#include "gpu/nccl_loader.h"
#include "gpu/pack_plan.h"

#if !defined(RR_HAVE_CUDA) || !defined(RR_HAVE_NCCL)
#error "RR_HAVE_CUDA and RR_HAVE_NCCL must be defined to 0 or 1 (setup.py does)"
#endif

#if RR_HAVE_CUDA
#include "gpu/device_query.h"
#include "gpu/selftest.h"
#endif

namespace py = pybind11;

namespace rr {
namespace {

#if RR_HAVE_CUDA
int device_count() {
  return gpu::cuda_device_count().count;
}
std::string unusable_reason() {
  return gpu::cuda_device_count().error;
}
std::string selftest(int device) {
  py::gil_scoped_release nogil;
  return gpu::kernel_selftest(device);
}
#else
int device_count() {
  return 0;
}
std::string unusable_reason() {
  return kBuiltWithoutCuda;
}
std::string selftest(int) {
  throw_error(ErrorKind::kInternal, kBuiltWithoutCuda);
}
#endif

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

py::dict plan_dict(const gpu::PackPlan& p) {
  U64Array offsets(static_cast<py::ssize_t>(p.offsets.size()));
  std::copy(p.offsets.begin(), p.offsets.end(), offsets.mutable_data());
  U64Array descs({static_cast<py::ssize_t>(p.descs.size()), py::ssize_t{3}});
  uint64_t* d = descs.mutable_data();
  for (const auto& c : p.descs) {
    *d++ = c.tensor;
    *d++ = c.fused;
    *d++ = c.bytes;
  }
  py::dict out;
  out["offsets"] = offsets;
  out["bytes"] = p.bytes;
  out["chunk_bytes"] = p.chunk_bytes;
  out["descs"] = descs;
  out["blocks"] = p.launch.blocks;
  out["threads"] = p.launch.threads;
  return out;
}

gpu::PackPlan plan(const U64Array& entries, uint64_t fusion_addr, uint64_t capacity,
                   uint64_t alignment, uint64_t chunk_bytes, uint32_t threads,
                   uint32_t max_blocks) {
  if (entries.size() != 0 && (entries.ndim() != 2 || entries.shape(1) != 2)) {
    throw_error(ErrorKind::kInvalidArgument, "plan_pack: entries must have shape (n, 2)");
  }
  std::vector<gpu::PackEntry> es(static_cast<size_t>(entries.size() / 2));
  const uint64_t* e = entries.data();
  for (auto& x : es) {
    x.addr = *e++;
    x.bytes = *e++;
  }
  gpu::PackOptions o;
  o.alignment = alignment;
  o.chunk_bytes = chunk_bytes;
  o.threads = threads;
  o.max_blocks = max_blocks;
  return gpu::plan_pack(es, fusion_addr, capacity, o);
}

std::vector<gpu::CopyDesc> descs_from(const U64Array& a) {
  if (a.size() != 0 && (a.ndim() != 2 || a.shape(1) != 3)) {
    throw_error(ErrorKind::kInvalidArgument, "reference_copy: descs must have shape (n, 3)");
  }
  std::vector<gpu::CopyDesc> out(static_cast<size_t>(a.size() / 3));
  const uint64_t* p = a.data();
  for (auto& d : out) {
    d.tensor = *p++;
    d.fused = *p++;
    d.bytes = *p++;
  }
  return out;
}

// A contiguous buffer's bytes as `count` elements of `dtype`.
uint64_t element_count(const py::buffer_info& b, DType dtype, const char* what) {
  const auto bytes = static_cast<uint64_t>(b.size * b.itemsize);
  const uint64_t size = dtype_size(dtype);
  if (bytes % size != 0) {
    throw_error(ErrorKind::kInvalidArgument, what, ": ", bytes, " bytes are not a whole number of ",
                dtype_name(dtype), " elements");
  }
  return bytes / size;
}

DType dtype_from(int code) {
  if (!dtype_is_valid(code)) throw_error(ErrorKind::kInvalidArgument, "unknown dtype code ", code);
  return static_cast<DType>(code);
}

}  // namespace

void bind_gpu(py::module_& parent) {
  py::module_ m = parent.def_submodule("gpu", "CUDA build and NCCL loading (see ringreduce._gpu)");
  m.def("cuda_built", [] { return RR_HAVE_CUDA != 0; });
#if RR_HAVE_CUDA
  m.def("cuda_runtime_version", &gpu::cuda_runtime_version);
  m.def("cuda_driver_version", &gpu::cuda_driver_version);
#else
  m.def("cuda_runtime_version", [] { return 0; });
  m.def("cuda_driver_version", [] { return 0; });
#endif
  // The first call initializes the driver (can take seconds on a large machine).
  m.def("cuda_device_count", &device_count, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_unusable_reason", &unusable_reason, py::call_guard<py::gil_scoped_release>());
  m.def("kernel_selftest", &selftest, py::arg("device") = 0);

  py::class_<gpu::NcclLibrary, std::shared_ptr<gpu::NcclLibrary>>(m, "NcclLibrary")
      .def_property_readonly("path", &gpu::NcclLibrary::path)
      .def_property_readonly("version", &gpu::NcclLibrary::version)
      .def("__repr__", [](const gpu::NcclLibrary& l) {
        return cat("<NcclLibrary ", gpu::nccl_version_string(l.version()), " from ", l.path(), ">");
      });
  m.def("load_nccl", &gpu::NcclLibrary::open, py::arg("dirs"),
        py::call_guard<py::gil_scoped_release>());
  m.def("nccl_version_string", &gpu::nccl_version_string);

  m.def(
      "plan_pack",
      [](const U64Array& entries, uint64_t fusion_addr, uint64_t capacity, uint64_t alignment,
         uint64_t chunk_bytes, uint32_t threads, uint32_t max_blocks) {
        return plan_dict(
            plan(entries, fusion_addr, capacity, alignment, chunk_bytes, threads, max_blocks));
      },
      py::arg("entries"), py::arg("fusion_addr"), py::arg("capacity"), py::arg("alignment") = 256,
      py::arg("chunk_bytes") = 0, py::arg("threads") = 256, py::arg("max_blocks") = 1024);
  m.def(
      "elementwise_launch",
      [](uint64_t count, uint32_t threads, uint32_t max_blocks) {
        const gpu::LaunchArgs a = gpu::elementwise_launch(count, threads, max_blocks);
        return py::make_tuple(a.blocks, a.threads);
      },
      py::arg("count"), py::arg("threads") = 256, py::arg("max_blocks") = 4096);

  // The kernels' code on the CPU. reference_copy dereferences the descriptors'
  // addresses: testing only, with host memory the caller keeps alive.
  m.def(
      "reference_copy",
      [](const U64Array& descs, bool pack) { gpu::reference_copy(descs_from(descs), pack); },
      py::arg("descs"), py::arg("pack"));
  m.def(
      "reference_scale",
      [](py::buffer data, int dtype, double factor) {
        const py::buffer_info b = data.request(true);
        const DType t = dtype_from(dtype);
        gpu::reference_scale(b.ptr, element_count(b, t, "reference_scale"), t, factor);
      },
      py::arg("data"), py::arg("dtype"), py::arg("factor"));
  m.def(
      "reference_cast",
      [](py::buffer src, int from, py::buffer dst, int to) {
        const py::buffer_info s = src.request();
        const py::buffer_info d = dst.request(true);
        const DType f = dtype_from(from), t = dtype_from(to);
        const uint64_t n = element_count(s, f, "reference_cast");
        if (element_count(d, t, "reference_cast") != n) {
          throw_error(ErrorKind::kInvalidArgument, "reference_cast: dst does not hold ", n, " ",
                      dtype_name(t), " elements");
        }
        gpu::reference_cast(s.ptr, f, d.ptr, t, n);
      },
      py::arg("src"), py::arg("from_dtype"), py::arg("dst"), py::arg("to_dtype"));
  m.def(
      "reference_cast_copy",
      [](const U64Array& descs, bool pack, int tensor, int wire, double factor) {
        gpu::reference_cast_copy(descs_from(descs), pack, dtype_from(tensor), dtype_from(wire),
                                 factor);
      },
      py::arg("descs"), py::arg("pack"), py::arg("tensor_dtype"), py::arg("wire_dtype"),
      py::arg("factor") = 1.0);
  m.def(
      "reference_fill",
      [](py::buffer data, uint32_t item_bytes, uint64_t pattern) {
        const py::buffer_info b = data.request(true);
        const auto bytes = static_cast<uint64_t>(b.size * b.itemsize);
        if (item_bytes == 0 || bytes % item_bytes)
          throw_error(ErrorKind::kInvalidArgument, "reference_fill: ", bytes,
                      " bytes are not whole elements of ", item_bytes);
        gpu::reference_fill(b.ptr, bytes / item_bytes, item_bytes, pattern);
      },
      py::arg("data"), py::arg("item_bytes"), py::arg("pattern"));
  bind_gpu_engine(m);
  bind_gpu_testing(m);
}

}  // namespace rr
