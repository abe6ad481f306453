#include "gpu/kernels_reference.h"

#include "gpu/elementwise.h"

namespace rr {
namespace gpu {

void reference_copy(const std::vector<CopyDesc>& descs, bool pack) {
  for (const CopyDesc& d : descs) {
    auto* tensor = reinterpret_cast<unsigned char*>(d.tensor);
    auto* fused = reinterpret_cast<unsigned char*>(d.fused);
    for (unsigned lane = 0; lane < kWarpSize; ++lane) {
      if (pack) {
        copy_lane(fused, tensor, d.bytes, lane, kWarpSize);
      } else {
        copy_lane(tensor, fused, d.bytes, lane, kWarpSize);
      }
    }
  }
}

void reference_scale(void* data, uint64_t count, DType dtype, double factor) {
  with_scale_op(dtype, [&](auto op) {
    using Op = decltype(op);
    auto* p = static_cast<typename Op::Storage*>(data);
    const auto f = static_cast<typename Op::Factor>(factor);
    for (uint64_t i = 0; i < count; ++i) p[i] = Op::apply(p[i], f);
  });
}

void reference_cast(const void* src, DType from, void* dst, DType to, uint64_t count) {
  with_cast_op(from, to, [&](auto op) {
    using Op = decltype(op);
    const auto* s = static_cast<const typename Op::Src*>(src);
    auto* d = static_cast<typename Op::Dst*>(dst);
    for (uint64_t i = 0; i < count; ++i) d[i] = Op::apply(s[i]);
  });
}

void reference_cast_copy(const std::vector<CopyDesc>& descs, bool pack, DType tensor, DType wire,
                         double factor) {
  with_scaled_cast_op(pack ? tensor : wire, pack ? wire : tensor, [&](auto op) {
    using Op = decltype(op);
    using Src = typename Op::Src;
    using Dst = typename Op::Dst;
    const auto f = static_cast<typename Op::Factor>(factor);
    for (const CopyDesc& d : descs) {
      const uint64_t n = d.bytes / (pack ? sizeof(Dst) : sizeof(Src));
      const auto* src = reinterpret_cast<const Src*>(pack ? d.tensor : d.fused);
      auto* dst = reinterpret_cast<Dst*>(pack ? d.fused : d.tensor);
      for (unsigned lane = 0; lane < kWarpSize; ++lane)
        cast_lane<Op>(src, dst, n, f, lane, kWarpSize);
    }
  });
}

namespace {
template <class T>
void fill_as(void* data, uint64_t count, uint64_t pattern) {
  fill_lane<T>(static_cast<T*>(data), count, static_cast<T>(pattern), 0, 1);
}
}  // namespace

void reference_fill(void* data, uint64_t count, uint32_t item_bytes, uint64_t pattern) {
  switch (item_bytes) {
    case 1: return fill_as<uint8_t>(data, count, pattern);
    case 2: return fill_as<uint16_t>(data, count, pattern);
    case 4: return fill_as<uint32_t>(data, count, pattern);
    case 8: return fill_as<uint64_t>(data, count, pattern);
    default: break;
  }
  throw_error(ErrorKind::kInvalidArgument, "GPU fill: elements of ", item_bytes,
              " bytes (1, 2, 4 or 8 are supported)");
}

}  // namespace gpu
}  // namespace rr
