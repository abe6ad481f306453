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

}  // namespace gpu
}  // namespace rr
