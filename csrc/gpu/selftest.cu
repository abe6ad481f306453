#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/error.h"
#include "gpu/kernels.h"
#include "gpu/kernels_reference.h"
#include "gpu/pack_plan.h"
#include "gpu/selftest.h"

namespace rr {
namespace gpu {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw_error(ErrorKind::kInternal, "GPU self-test: ", what, ": ", cudaGetErrorName(err), ": ",
                cudaGetErrorString(err));
  }
}

// Device memory freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { check(cudaMalloc(&ptr_, bytes ? bytes : 1), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

void to_device(void* dst, const void* src, size_t n) {
  check(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

void to_host(void* dst, const void* src, size_t n) {
  check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

std::vector<unsigned char> random_bytes(size_t n, std::mt19937_64& rng) {
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// Tensors at offsets of every alignment class (16, 4, 1) inside one arena,
// packed and unpacked with a small chunk so that tensors split.
std::string check_pack(std::mt19937_64& rng) {
  const std::vector<std::pair<uint64_t, uint64_t>> layout = {// (arena offset, bytes)
                                                             {0, 1 << 20},
                                                             {(1 << 20) + 16, 4},
                                                             {(1 << 20) + 64, 0},
                                                             {(1 << 20) + 68, 1001},
                                                             {(1 << 21) + 3, 77777},
                                                             {(1 << 22), 40000},
                                                             {(1 << 22) + 65536 + 1, 1}};
  const uint64_t arena_bytes = (1 << 23);
  DeviceBuffer arena(arena_bytes), out(arena_bytes), fusion(arena_bytes);
  const std::vector<unsigned char> data = random_bytes(arena_bytes, rng);
  to_device(arena.get(), data.data(), arena_bytes);
  check(cudaMemset(out.get(), 0, arena_bytes), "cudaMemset");

  std::vector<PackEntry> in_entries, out_entries;
  for (const auto& [off, n] : layout) {
    in_entries.push_back({arena.addr() + off, n});
    out_entries.push_back({out.addr() + off, n});
  }
  PackOptions opt;
  opt.chunk_bytes = 4096;
  opt.max_blocks = 3;
  const PackPlan in = plan_pack(in_entries, fusion.addr(), arena_bytes, opt);
  const PackPlan outp = plan_pack(out_entries, fusion.addr(), arena_bytes, opt);
  DeviceBuffer descs(in.descs.size() * sizeof(CopyDesc) + outp.descs.size() * sizeof(CopyDesc));
  auto* d_in = reinterpret_cast<CopyDesc*>(descs.get());
  auto* d_out = d_in + in.descs.size();
  to_device(d_in, in.descs.data(), in.descs.size() * sizeof(CopyDesc));
  to_device(d_out, outp.descs.data(), outp.descs.size() * sizeof(CopyDesc));
  launch_pack(d_in, in.descs.size(), in.launch, nullptr);
  launch_unpack(d_out, outp.descs.size(), outp.launch, nullptr);
  check(cudaDeviceSynchronize(), "pack / unpack");

  std::vector<unsigned char> fused(in.bytes), back(arena_bytes);
  to_host(fused.data(), fusion.get(), in.bytes);
  to_host(back.data(), out.get(), arena_bytes);
  for (size_t i = 0; i < layout.size(); ++i) {
    const auto [off, n] = layout[i];
    if (std::memcmp(fused.data() + in.offsets[i], data.data() + off, n) != 0) {
      return cat("pack: tensor ", i, " (", n, " bytes at arena offset ", off, ") differs");
    }
    if (std::memcmp(back.data() + off, data.data() + off, n) != 0) {
      return cat("unpack: tensor ", i, " (", n, " bytes at arena offset ", off, ") differs");
    }
  }
  return "";
}

std::string check_scale(std::mt19937_64& rng) {
  const uint64_t count = 100003;
  for (int code = 0; code <= 7; ++code) {
    const auto dtype = static_cast<DType>(code);
    const size_t bytes = count * dtype_size(dtype);
    std::vector<unsigned char> host = random_bytes(bytes, rng);
    std::vector<unsigned char> got(bytes);
    DeviceBuffer dev(bytes);
    to_device(dev.get(), host.data(), bytes);
    for (double factor : {0.5, 1.0 / 3.0, -7.25}) {
      launch_scale(dev.get(), count, dtype, factor, nullptr);
      reference_scale(host.data(), count, dtype, factor);
    }
    check(cudaDeviceSynchronize(), "scale");
    to_host(got.data(), dev.get(), bytes);
    if (got != host) return cat("scale: ", dtype_name(dtype), " differs from the CPU reference");
  }
  return "";
}

std::string check_cast(std::mt19937_64& rng) {
  const uint64_t count = 100003;
  const std::pair<DType, DType> pairs[] = {
      {DType::kFloat32, DType::kFloat16},  {DType::kFloat16, DType::kFloat32},
      {DType::kFloat32, DType::kBFloat16}, {DType::kBFloat16, DType::kFloat32},
      {DType::kFloat64, DType::kFloat16},  {DType::kFloat16, DType::kFloat64},
      {DType::kFloat64, DType::kBFloat16}, {DType::kBFloat16, DType::kFloat64}};
  for (const auto& [from, to] : pairs) {
    const size_t in_bytes = count * dtype_size(from), out_bytes = count * dtype_size(to);
    const std::vector<unsigned char> src = random_bytes(in_bytes, rng);
    std::vector<unsigned char> want(out_bytes), got(out_bytes);
    DeviceBuffer d_src(in_bytes), d_dst(out_bytes);
    to_device(d_src.get(), src.data(), in_bytes);
    launch_cast(d_src.get(), from, d_dst.get(), to, count, nullptr);
    check(cudaDeviceSynchronize(), "cast");
    to_host(got.data(), d_dst.get(), out_bytes);
    reference_cast(src.data(), from, want.data(), to, count);
    if (got != want) {
      return cat("cast ", dtype_name(from), " -> ", dtype_name(to),
                 " differs from the CPU reference");
    }
  }
  return "";
}

uint64_t host_addr(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

// Compression's batched casts: pack (tensor -> wire, times 0.75) and unpack
// (wire -> tensor, times -3) in chunks of 4 KiB of wire bytes, on random
// bytes, against the CPU reference of the same descriptors.
std::string check_cast_copy(std::mt19937_64& rng) {
  const uint64_t count = 50001, chunk = 4096;
  const std::pair<DType, DType> pairs[] = {{DType::kFloat32, DType::kFloat16},
                                           {DType::kFloat32, DType::kBFloat16},
                                           {DType::kFloat64, DType::kFloat16},
                                           {DType::kFloat64, DType::kBFloat16}};
  for (const auto& [tensor, wire] : pairs) {
    const uint64_t ti = dtype_size(tensor), wi = dtype_size(wire);
    const std::vector<unsigned char> t = random_bytes(count * ti, rng);
    std::vector<unsigned char> w_want(count * wi), t_want(count * ti);
    std::vector<unsigned char> w_got(count * wi), t_got(count * ti);
    DeviceBuffer d_t(count * ti), d_w(count * wi), d_back(count * ti);
    to_device(d_t.get(), t.data(), t.size());
    std::vector<CopyDesc> dev, host, dev_back, host_back;
    for (uint64_t done = 0; done < count * wi; done += chunk) {
      const uint64_t n = std::min(chunk, count * wi - done), at = done / wi * ti;
      dev.push_back({d_t.addr() + at, d_w.addr() + done, n});
      dev_back.push_back({d_back.addr() + at, d_w.addr() + done, n});
      host.push_back({host_addr(t.data()) + at, host_addr(w_want.data()) + done, n});
      host_back.push_back({host_addr(t_want.data()) + at, host_addr(w_want.data()) + done, n});
    }
    DeviceBuffer descs(2 * dev.size() * sizeof(CopyDesc));
    auto* d_pack = reinterpret_cast<CopyDesc*>(descs.get());
    to_device(d_pack, dev.data(), dev.size() * sizeof(CopyDesc));
    to_device(d_pack + dev.size(), dev_back.data(), dev.size() * sizeof(CopyDesc));
    const LaunchArgs launch{3, 64};
    launch_cast_copy(d_pack, dev.size(), true, tensor, wire, 0.75, launch, nullptr);
    launch_cast_copy(d_pack + dev.size(), dev.size(), false, tensor, wire, -3.0, launch, nullptr);
    check(cudaDeviceSynchronize(), "cast copy");
    to_host(w_got.data(), d_w.get(), w_got.size());
    to_host(t_got.data(), d_back.get(), t_got.size());
    reference_cast_copy(host, true, tensor, wire, 0.75);
    reference_cast_copy(host_back, false, tensor, wire, -3.0);
    if (w_got != w_want || t_got != t_want)
      return cat(w_got != w_want ? "pack" : "unpack", " with a cast ", dtype_name(tensor), " / ",
                 dtype_name(wire), " differs from the CPU reference");
  }
  return "";
}

std::string check_fill(std::mt19937_64& rng) {
  const uint64_t count = 10007, pattern = rng();
  for (uint32_t item : {1u, 2u, 4u, 8u}) {
    std::vector<unsigned char> want(count * item), got(count * item);
    DeviceBuffer dev(count * item);
    launch_fill(dev.get(), count, item, pattern, nullptr);
    check(cudaDeviceSynchronize(), "fill");
    to_host(got.data(), dev.get(), got.size());
    reference_fill(want.data(), count, item, pattern);
    if (got != want) return cat("fill of ", item, "-byte elements differs from the CPU reference");
  }
  return "";
}

}  // namespace

std::string kernel_selftest(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  std::mt19937_64 rng(12345);
  for (auto* step : {&check_pack, &check_scale, &check_cast, &check_cast_copy, &check_fill}) {
    std::string err = step(rng);
    if (!err.empty()) return err;
  }
  return "";
}

}  // namespace gpu
}  // namespace rr
