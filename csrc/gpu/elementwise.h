// The per-element and per-lane code of the GPU kernels, written once for
// host and device: kernels.cu runs it in CUDA kernels, kernels_reference.cc
// runs the same functions on the CPU so that tests on machines without a GPU
// check the arithmetic, the vectorized copy and its tails.
//
// Bits match the CPU kernels (collectives/reduce_kernels.cc): float16 and
// bfloat16 are widened exactly to float32, scaled there and rounded to
// nearest even; a NaN stays the same NaN; integers are scaled in double,
// rounded half away from zero and saturated (NaN -> 0). float64 -> float16 /
// bfloat16 rounds once (round to odd into float32 first, so the second
// rounding is the correct one).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/dtype.h"
#include "common/error.h"

#if defined(__CUDACC__)
#define RR_HD __host__ __device__ __forceinline__
#else
#define RR_HD inline
#endif

namespace rr {
namespace gpu {

template <class To, class From>
RR_HD To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bits_as needs equal sizes");
  To t;
  memcpy(&t, &x, sizeof(t));
  return t;
}

// ---- Codecs: how an element is stored and in which type it is computed. ----

template <class T>
struct Plain {
  using Storage = T;
  using Compute = T;
  RR_HD static T load(T x) { return x; }
  RR_HD static T store(T x) { return x; }
};

// IEEE binary16, the integer codec of the CPU kernels (same bits as F16C).
struct Half {
  using Storage = uint16_t;
  using Compute = float;

  RR_HD static float load(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t bits;
    if (em < 0x400u) {  // zero and subnormals: em * 2^-24 is exact
      bits = bits_as<uint32_t>(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
    } else if (em >= 0x7c00u) {  // inf, NaN (quieted, payload kept)
      bits = (em << 13) | 0x7f800000u | (static_cast<uint32_t>(em > 0x7c00u) << 22);
    } else {
      bits = (em << 13) + 0x38000000u;
    }
    return bits_as<float>(bits | sign);
  }

  RR_HD static uint16_t store(float f) {
    const uint32_t x = bits_as<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    uint32_t r;
    if (ax > 0x7f800000u) {
      r = 0x7e00u | ((ax >> 13) & 0x3ffu);
    } else if (ax >= 0x47800000u) {
      r = 0x7c00u;
    } else if (ax < 0x38800000u) {
      // Adding 0.5 puts the float32 ulp at 2^-24, the float16 subnormal step:
      // the add rounds to nearest even.
      r = bits_as<uint32_t>(bits_as<float>(ax) + 0.5f) - 0x3f000000u;
    } else {
      r = (ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13;
    }
    return static_cast<uint16_t>(r | sign);
  }
};

// bfloat16: the top half of a float32; round to nearest even, NaN stays NaN.
struct BHalf {
  using Storage = uint16_t;
  using Compute = float;
  RR_HD static float load(uint16_t h) { return bits_as<float>(static_cast<uint32_t>(h) << 16); }
  RR_HD static uint16_t store(float f) {
    const uint32_t x = bits_as<uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
};

// float64 -> float32 rounded to odd: truncate, and set the last bit if
// anything was dropped. Rounding that once more to float16 / bfloat16 (far
// fewer bits) gives the correctly rounded result.
// NaN payloads are moved by bits, as x86 does (GPU conversions make every
// NaN the canonical one).
RR_HD float double_to_float_odd(double d) {
  if (d != d) {
    const uint64_t x = bits_as<uint64_t>(d);
    const auto sign = static_cast<uint32_t>(x >> 32) & 0x80000000u;
    return bits_as<float>(sign | 0x7fc00000u | static_cast<uint32_t>((x >> 29) & 0x3fffffu));
  }
  const float f = static_cast<float>(d);
  const double back = static_cast<double>(f);
  if (back == d || back - back != 0.0) return f;  // exact, or overflowed to inf
  uint32_t b = bits_as<uint32_t>(f);
  if ((back < 0 ? -back : back) > (d < 0 ? -d : d)) b -= 1;  // rounded away from zero
  return bits_as<float>(b | 1u);
}

// ---- Scaling in place: out = x * factor. ----

template <class C>
struct ScaleFloat {
  using Storage = typename C::Storage;
  using Factor = typename C::Compute;  // float32 factor for float16/bfloat16/float32
  RR_HD static Storage apply(Storage s, Factor f) {
    const auto x = C::load(s);
    return C::store(x != x ? x : x * f);
  }
};

template <class T>
struct ScaleInt {
  using Storage = T;
  using Factor = double;
  RR_HD static T apply(T x, double f) {
    using W = std::conditional_t<(sizeof(T) < 8), int32_t, int64_t>;
    using U = std::make_unsigned_t<T>;
    // Not numeric_limits: its functions are host-only in device code.
    constexpr T kMax = std::is_signed<T>::value ? T(U(~U(0)) >> 1) : T(~U(0));
    constexpr T kMin = std::is_signed<T>::value ? T(-kMax - 1) : T(0);
    constexpr double kLo = static_cast<double>(kMin);
    constexpr double kHi = static_cast<double>(kMax);  // 2^63 for int64
    const double y = static_cast<double>(x) * f;
    if (y != y) return T{0};
    if (y <= kLo) return kMin;
    if (y >= kHi) return kMax;
    W t = static_cast<W>(y);  // truncates
    const double frac = y - static_cast<double>(t);
    t += static_cast<W>(frac >= 0.5) - static_cast<W>(frac <= -0.5);
    return static_cast<T>(t);
  }
};

// Calls f(Op{}) with the scale operation of `dtype`.
template <class F>
void with_scale_op(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kUInt8: return f(ScaleInt<uint8_t>{});
    case DType::kInt8: return f(ScaleInt<int8_t>{});
    case DType::kInt32: return f(ScaleInt<int32_t>{});
    case DType::kInt64: return f(ScaleInt<int64_t>{});
    case DType::kFloat16: return f(ScaleFloat<Half>{});
    case DType::kBFloat16: return f(ScaleFloat<BHalf>{});
    case DType::kFloat32: return f(ScaleFloat<Plain<float>>{});
    case DType::kFloat64: return f(ScaleFloat<Plain<double>>{});
    case DType::kBool:
    case DType::kInt16:  // the 16-bit and unsigned 32/64-bit integers are CPU-only for now
    case DType::kUInt16:
    case DType::kUInt32:
    case DType::kUInt64: break;
  }
  throw_error(ErrorKind::kInvalidArgument, "GPU scale: dtype ",
              dtype_is_valid(static_cast<int32_t>(dtype)) ? dtype_name(dtype) : "(invalid)",
              " cannot be scaled");
}

// ---- Casts (fp16 / bf16 compression and back). ----

template <class From, class To>
struct Cast {
  using Src = typename From::Storage;
  using Dst = typename To::Storage;
  RR_HD static Dst apply(Src x) { return To::store(From::load(x)); }
};

// float64 -> float16 / bfloat16: one correct rounding (see double_to_float_odd).
template <class To>
struct CastFromDouble {
  using Src = double;
  using Dst = typename To::Storage;
  RR_HD static Dst apply(double x) { return To::store(double_to_float_odd(x)); }
};

template <class From>
struct CastToDouble {
  using Src = typename From::Storage;
  using Dst = double;
  RR_HD static double apply(Src x) {
    const float f = From::load(x);
    if (f == f) return static_cast<double>(f);  // exact
    const auto b = static_cast<uint64_t>(bits_as<uint32_t>(f));
    return bits_as<double>(((b & 0x80000000u) << 32) | 0x7ff8000000000000ull |
                           ((b & 0x3fffffu) << 29));
  }
};

// Calls f(Op{}) with the cast from `from` to `to`: float32/float64 to and from
// float16/bfloat16.
template <class F>
void with_cast_op(DType from, DType to, F&& f) {
  using D = DType;
  if (from == D::kFloat32 && to == D::kFloat16) return f(Cast<Plain<float>, Half>{});
  if (from == D::kFloat16 && to == D::kFloat32) return f(Cast<Half, Plain<float>>{});
  if (from == D::kFloat32 && to == D::kBFloat16) return f(Cast<Plain<float>, BHalf>{});
  if (from == D::kBFloat16 && to == D::kFloat32) return f(Cast<BHalf, Plain<float>>{});
  if (from == D::kFloat64 && to == D::kFloat16) return f(CastFromDouble<Half>{});
  if (from == D::kFloat16 && to == D::kFloat64) return f(CastToDouble<Half>{});
  if (from == D::kFloat64 && to == D::kBFloat16) return f(CastFromDouble<BHalf>{});
  if (from == D::kBFloat16 && to == D::kFloat64) return f(CastToDouble<BHalf>{});
  auto name = [](DType t) {
    return dtype_is_valid(static_cast<int32_t>(t)) ? dtype_name(t) : "(invalid)";
  };
  throw_error(ErrorKind::kInvalidArgument, "GPU cast from ", name(from), " to ", name(to),
              " is not supported (float32/float64 to and from float16/bfloat16 are)");
}

// ---- Compression: a cast with a scale folded in (the executor's fused
// fp16 / bf16 allreduce packs with a prescale and unpacks with a postscale).
// The scale runs in the wider type (float32, or float64 for float64
// tensors), before the narrowing or after the widening, so there is one
// rounding to the wire type; a factor of 1 gives the plain cast's bits.

template <class From, class To>  // float32 <-> float16 / bfloat16, computed in float32
struct ScaledCast {
  using Src = typename From::Storage;
  using Dst = typename To::Storage;
  using Factor = float;
  RR_HD static Dst apply(Src s, float f) {
    const float x = From::load(s);
    return To::store(x != x ? x : x * f);
  }
};

template <class To>  // float64 -> float16 / bfloat16
struct ScaledCastFromDouble {
  using Src = double;
  using Dst = typename To::Storage;
  using Factor = double;
  RR_HD static Dst apply(double x, double f) {
    return CastFromDouble<To>::apply(x != x ? x : x * f);
  }
};

template <class From>  // float16 / bfloat16 -> float64
struct ScaledCastToDouble {
  using Src = typename From::Storage;
  using Dst = double;
  using Factor = double;
  RR_HD static double apply(Src s, double f) {
    const double x = CastToDouble<From>::apply(s);
    return x != x ? x : x * f;
  }
};

// Calls f(Op{}) with the scaled cast from `from` to `to` (the pairs of with_cast_op).
template <class F>
void with_scaled_cast_op(DType from, DType to, F&& f) {
  using D = DType;
  if (from == D::kFloat32 && to == D::kFloat16) return f(ScaledCast<Plain<float>, Half>{});
  if (from == D::kFloat16 && to == D::kFloat32) return f(ScaledCast<Half, Plain<float>>{});
  if (from == D::kFloat32 && to == D::kBFloat16) return f(ScaledCast<Plain<float>, BHalf>{});
  if (from == D::kBFloat16 && to == D::kFloat32) return f(ScaledCast<BHalf, Plain<float>>{});
  if (from == D::kFloat64 && to == D::kFloat16) return f(ScaledCastFromDouble<Half>{});
  if (from == D::kFloat16 && to == D::kFloat64) return f(ScaledCastToDouble<Half>{});
  if (from == D::kFloat64 && to == D::kBFloat16) return f(ScaledCastFromDouble<BHalf>{});
  if (from == D::kBFloat16 && to == D::kFloat64) return f(ScaledCastToDouble<BHalf>{});
  with_cast_op(from, to, [](auto) {});  // throws the cast's message
}

// The share of lane `lane` of `lanes` in one descriptor of a batched cast:
// elements lane, lane + lanes, ... of `count`.
template <class Op>
RR_HD void cast_lane(const typename Op::Src* src, typename Op::Dst* dst, uint64_t count,
                     typename Op::Factor f, unsigned lane, unsigned lanes) {
  for (uint64_t i = lane; i < count; i += lanes) dst[i] = Op::apply(src[i], f);
}

// One element's bits repeated: the fill of a joined rank's neutral elements.
template <class T>
RR_HD void fill_lane(T* dst, uint64_t count, T value, uint64_t first, uint64_t stride) {
  for (uint64_t i = first; i < count; i += stride) dst[i] = value;
}

// ---- Batched copy: the share of one lane of a warp in one descriptor. ----

// Lane `lane` of `lanes` copies elements lane, lane + lanes, ... in units of
// 16 bytes when both sides are 16-byte aligned, else 4 bytes, else 1; the
// tail past the last whole unit goes byte by byte.
template <class Unit>
RR_HD void copy_unit(unsigned char* dst, const unsigned char* src) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Unit*>(dst) = *reinterpret_cast<const Unit*>(src);
#else
  memcpy(dst, src, sizeof(Unit));
#endif
}

struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <class Unit>
RR_HD uint64_t copy_units(unsigned char* dst, const unsigned char* src, uint64_t bytes,
                          unsigned lane, unsigned lanes) {
  const uint64_t n = bytes / sizeof(Unit);
  for (uint64_t i = lane; i < n; i += lanes) {
    copy_unit<Unit>(dst + i * sizeof(Unit), src + i * sizeof(Unit));
  }
  return n * sizeof(Unit);
}

RR_HD void copy_lane(unsigned char* dst, const unsigned char* src, uint64_t bytes, unsigned lane,
                     unsigned lanes) {
  const uint64_t both = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  uint64_t done;
  if (both % 16 == 0) {
    done = copy_units<Bytes16>(dst, src, bytes, lane, lanes);
  } else if (both % 4 == 0) {
    done = copy_units<uint32_t>(dst, src, bytes, lane, lanes);
  } else {
    done = 0;
  }
  for (uint64_t i = done + lane; i < bytes; i += lanes) dst[i] = src[i];
}

}  // namespace gpu
}  // namespace rr
