// Element-wise reduction kernels.
//
// Determinism contract: every output element is a pure function of the input
// elements at the same index (plus the op, factor or divisor) and never of the
// CPU's vector width, alignment or the clone that runs. Per element:
//  - float32/float64 Sum/Product: one IEEE operation (-ffp-contract=off, no
//    -ffast-math; no kernel has a multiply feeding an add anyway). If a is
//    NaN the result is a unchanged, so two NaNs cannot give operand-order-
//    dependent payloads. Min/Max: a NaN operand wins (a first); ties give b.
//  - float16/bfloat16: widened exactly to float32, computed as above, rounded
//    to nearest even once. float16 conversions are F16C or portable integer
//    code with identical bits (exhaustively checked, also under DAZ/FTZ).
//  - integers: Sum/Product wrap (unsigned arithmetic); scaling multiplies in
//    double, rounds half away from zero and saturates; division is exact.
// Assumes the default MXCSR rounding mode, as all float32 arithmetic does.
// Loops are compiled once per ISA with GCC target_clones and picked at load.

#include "collectives/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "common/error.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define RR_KERNEL_X86 1
#define RR_KERNEL_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// Additive ISA flags (not arch=) so that builds with a higher -march still compile.
#define RR_KERNEL_F16C __attribute__((target("avx,f16c")))
#else
#define RR_KERNEL_X86 0
#define RR_KERNEL_CLONES
#endif

namespace rr {
namespace {

template <class To, class From>
inline To bit_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bit_as needs equal sizes");
  return __builtin_bit_cast(To, x);
}

// Branch-free select. Under the default -ftrapping-math GCC may turn a ?: into
// a branch that guards a float operation or conversion, and then it cannot
// if-convert the loop body back, so the loop stays scalar. Masks avoid that.
template <class T>
inline T select(bool c, T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    using U = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
    return bit_as<T>(select(c, bit_as<U>(a), bit_as<U>(b)));
  } else {
    const T mask = static_cast<T>(T{0} - static_cast<T>(c));
    return static_cast<T>((a & mask) | (b & ~mask));
  }
}

// ---- Codecs: how an element is stored and in which type it is computed. ----

template <class T>
struct Plain {
  using Storage = T;
  using Compute = T;
  static T load(T x) { return x; }
  static T store(T x) { return x; }
};

// Bytes holding 0/1; any nonzero byte reads as true, results are 0 or 1.
struct Bool {
  using Storage = uint8_t;
  using Compute = bool;
  static bool load(uint8_t x) { return x != 0; }
  static uint8_t store(bool b) { return static_cast<uint8_t>(b); }
};

// IEEE binary16, bit-identical to F16C's VCVTPH2PS and VCVTPS2PH (round to
// nearest even) in both directions (checked exhaustively): NaNs are quieted
// and keep their payload. Integer steps, exact float steps and one float add
// whose rounding is the wanted one.
struct Half {
  using Storage = uint16_t;
  using Compute = float;

  static float load(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t normal = (em << 13) + 0x38000000u;  // rebias exponent 15 -> 127
    const uint32_t quiet = static_cast<uint32_t>(em > 0x7c00u) << 22;
    const uint32_t special = (em << 13) | 0x7f800000u | quiet;  // inf and NaN
    // Subnormals: em * 2^-24 is exact in float32 and a normal float.
    const uint32_t sub = bit_as<uint32_t>(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
    uint32_t bits = select(em >= 0x7c00u, special, normal);
    bits = select(em < 0x400u, sub, bits);
    return bit_as<float>(bits | sign);
  }

  static uint16_t store(float f) {
    const uint32_t x = bit_as<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    // Normal range: rebias, then round to nearest even on the 13 dropped bits.
    const uint32_t normal = (ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13;
    // Below 2^-14: adding 0.5 puts the float32 ulp at 2^-24 (the float16
    // subnormal step), so the hardware add rounds to nearest even for us.
    const uint32_t sub = bit_as<uint32_t>(bit_as<float>(ax) + 0.5f) - 0x3f000000u;
    const uint32_t nan = 0x7e00u | ((ax >> 13) & 0x3ffu);
    uint32_t r = select(ax < 0x38800000u, sub, normal);
    r = select(ax >= 0x47800000u, 0x7c00u, r);  // overflow and inf
    r = select(ax > 0x7f800000u, nan, r);
    return static_cast<uint16_t>(r | sign);
  }
};

// bfloat16: the top half of a float32; rounding to nearest even, NaN stays NaN.
struct BHalf {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t h) { return bit_as<float>(static_cast<uint32_t>(h) << 16); }
  static uint16_t store(float f) {
    const uint32_t x = bit_as<uint32_t>(f);
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    const uint32_t nan = (x >> 16) | 0x40u;
    return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
};

// ---- Element operations on the compute type. ----

template <class T>
inline bool is_nan(T x) {
  if constexpr (std::is_floating_point_v<T>) {
    return x != x;
  } else {
    return false;
  }
}

// When both operands of an IEEE add or multiply are NaN, x86 returns the first
// source operand, and the compiler may order commutative operands differently
// in each clone. Returning a NaN a unchanged pins the result bits down (with a
// single NaN operand the hardware result is already unique).
template <class T>
inline T nan_from_a(T a, T r) {
  return select(is_nan(a), a, r);
}

template <class T>
constexpr bool kWraps = std::is_integral_v<T> && !std::is_same_v<T, bool>;

struct OpSum {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (std::is_same_v<T, bool>) {
      return a || b;
    } else if constexpr (kWraps<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return nan_from_a(a, a + b);
    }
  }
};

struct OpProduct {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (std::is_same_v<T, bool>) {
      return a && b;
    } else if constexpr (kWraps<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return nan_from_a(a, a * b);
    }
  }
};

// numpy.minimum/maximum: a NaN operand propagates; on ties b is returned.
struct OpMin {
  template <class T>
  static T apply(T a, T b) {
    return (a < b || is_nan(a)) ? a : b;
  }
};

struct OpMax {
  template <class T>
  static T apply(T a, T b) {
    return (a > b || is_nan(a)) ? a : b;
  }
};

// ---- Loops (one clone per instruction set). ----

// No restrict: dst may equal a and/or b. GCC's run-time overlap check accepts
// identical pointers, so the in-place case stays vectorised.
template <class C, class Op>
RR_KERNEL_CLONES void combine(typename C::Storage* dst, const typename C::Storage* a,
                              const typename C::Storage* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = C::store(Op::apply(C::load(a[i]), C::load(b[i])));
  }
}

template <class C>
RR_KERNEL_CLONES void scale_float(typename C::Storage* buf, size_t n, typename C::Compute factor) {
  for (size_t i = 0; i < n; ++i) {
    const auto x = C::load(buf[i]);
    buf[i] = C::store(nan_from_a(x, x * factor));
  }
}

// Bulk float16 <-> float32: F16C where the CPU has it, else the portable
// codec. Both give the same bits.
#if RR_KERNEL_X86
bool cpu_has_f16c() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

RR_KERNEL_F16C void half_to_float_f16c(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = Half::load(src[i]);
}

RR_KERNEL_F16C void float_to_half_f16c(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = Half::store(src[i]);
}
#endif

void half_to_float(const uint16_t* src, float* dst, size_t n) {
#if RR_KERNEL_X86
  if (cpu_has_f16c()) return half_to_float_f16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = Half::load(src[i]);
}

void float_to_half(const float* src, uint16_t* dst, size_t n) {
#if RR_KERNEL_X86
  if (cpu_has_f16c()) return float_to_half_f16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = Half::store(src[i]);
}

// float16 runs the float32 kernels on blocks converted in bulk. Each block of
// a and b is read before dst is written, so any aliasing is fine.
constexpr size_t kHalfBlock = 1024;

// Runs f(fa, fb, m) on blocks of a and b converted to float; with a dst,
// writes each block's fa back to it.
template <class F>
void half_blocks(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, F&& f) {
  alignas(64) float fa[kHalfBlock];
  alignas(64) float fb[kHalfBlock];
  for (size_t i = 0; i < n; i += kHalfBlock) {
    const size_t m = std::min(kHalfBlock, n - i);
    half_to_float(a + i, fa, m);
    half_to_float(b + i, fb, m);
    f(fa, fb, m);
    if (dst) float_to_half(fa, dst + i, m);
  }
}

template <class Op>
void combine_half(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n) {
  half_blocks(dst, a, b, n,
              [](float* x, const float* y, size_t m) { combine<Plain<float>, Op>(x, x, y, m); });
}

void scale_half(uint16_t* buf, size_t n, float factor) {
  alignas(64) float f[kHalfBlock];
  for (size_t i = 0; i < n; i += kHalfBlock) {
    const size_t m = std::min(kHalfBlock, n - i);
    half_to_float(buf + i, f, m);
    scale_float<Plain<float>>(f, m, factor);
    float_to_half(f, buf + i, m);
  }
}

// ---- Adasum (allreduce_adasum.cc). ----

// Eight running sums per quantity, element i feeding lane i % 8, added up in
// lane order at the end: the bits depend on the elements only, not on the
// vector width (each lane is one chain of IEEE double operations).
constexpr size_t kLanes = 8;
struct DotLanes {
  double ab[kLanes] = {}, aa[kLanes] = {}, bb[kLanes] = {};
};

template <class C>
RR_KERNEL_CLONES void dot_lanes(const typename C::Storage* a, const typename C::Storage* b,
                                size_t n, DotLanes* acc) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) {
      const double x = static_cast<double>(C::load(a[i + j]));
      const double y = static_cast<double>(C::load(b[i + j]));
      acc->ab[j] += x * y;
      acc->aa[j] += x * x;
      acc->bb[j] += y * y;
    }
  }
  for (size_t j = 0; i + j < n; ++j) {
    const double x = static_cast<double>(C::load(a[i + j]));
    const double y = static_cast<double>(C::load(b[i + j]));
    acc->ab[j] += x * y;
    acc->aa[j] += x * x;
    acc->bb[j] += y * y;
  }
}

// dst[i] = ca * a[i] + cb * b[i] in the compute type (float for float16 /
// bfloat16 / float32, double for float64); no restrict: dst may be a or b.
template <class C>
RR_KERNEL_CLONES void scaled_add(typename C::Storage* dst, const typename C::Storage* a,
                                 const typename C::Storage* b, size_t n, typename C::Compute ca,
                                 typename C::Compute cb) {
  for (size_t i = 0; i < n; ++i) dst[i] = C::store(ca * C::load(a[i]) + cb * C::load(b[i]));
}

template <class C>
void adasum_dots_typed(const void* a, const void* b, size_t n, double out[3]) {
  DotLanes acc;
  using S = typename C::Storage;
  if constexpr (std::is_same_v<C, Half>) {  // blocks converted in bulk; kHalfBlock % 8 == 0
    half_blocks(
        nullptr, static_cast<const S*>(a), static_cast<const S*>(b), n,
        [&acc](float* x, const float* y, size_t m) { dot_lanes<Plain<float>>(x, y, m, &acc); });
  } else {
    dot_lanes<C>(static_cast<const S*>(a), static_cast<const S*>(b), n, &acc);
  }
  for (size_t j = 0; j < kLanes; ++j) {
    out[0] += acc.ab[j];
    out[1] += acc.aa[j];
    out[2] += acc.bb[j];
  }
}

void scaled_add_half(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, float ca,
                     float cb) {
  half_blocks(dst, a, b, n, [ca, cb](float* x, const float* y, size_t m) {
    scaled_add<Plain<float>>(x, x, y, m, ca, cb);
  });
}

// round_saturate for uint64, whose range no signed type holds.
inline uint64_t round_saturate_u64(double y) {
  constexpr double kTop = 0x1.fffffffffffffp63;  // the largest double below 2^64
  double c = select(y > 0.0, y, 0.0);            // NaN and negatives -> 0
  c = select(c < kTop, c, kTop);
  uint64_t t = static_cast<uint64_t>(c);  // truncates
  t += static_cast<uint64_t>(c - static_cast<double>(t) >= 0.5);
  return select(y >= 0x1p64, std::numeric_limits<uint64_t>::max(), t);
}

// Rounds half away from zero and saturates to T; NaN becomes 0.
template <class T>
inline T round_saturate(double y) {
  if constexpr (std::is_same_v<T, uint64_t>) {
    return round_saturate_u64(y);
  } else {
    // W holds every value of T: int32 for the small types, int64 for uint32 and int64.
    using W = std::conditional_t<(sizeof(T) < 4 || std::is_same_v<T, int32_t>), int32_t, int64_t>;
    constexpr W kMin = std::numeric_limits<T>::min();
    constexpr W kMax = std::numeric_limits<T>::max();
    constexpr double kLo = static_cast<double>(kMin);
    constexpr double kHi = static_cast<double>(kMax);  // 2^63 for int64, not convertible
    constexpr double kTop = sizeof(T) < 8 ? kHi : 0x1.fffffffffffffp62;  // largest convertible
    double c = select(y > kLo, y, kLo);                                  // NaN -> kLo, fixed below
    c = select(c < kTop, c, kTop);
    W t = static_cast<W>(c);                         // truncates
    const double frac = c - static_cast<double>(t);  // exact
    t += static_cast<W>(frac >= 0.5) - static_cast<W>(frac <= -0.5);
    t = select(y >= kHi, kMax, t);
    t = select(y != y, W{0}, t);
    return static_cast<T>(t);
  }
}

template <class T>
RR_KERNEL_CLONES void scale_int(T* buf, size_t n, double factor) {
  for (size_t i = 0; i < n; ++i) buf[i] = round_saturate<T>(static_cast<double>(buf[i]) * factor);
}

// x / d for |x| < 2^31 and |d| >= 2: the double quotient is within |q|*2^-53
// of the exact one, closer than any non-integer quotient gets to an integer
// (1/|d|), so truncating it is exact. |q| <= 2^30 fits int32.
template <class T>
RR_KERNEL_CLONES void divide_small(T* buf, size_t n, double d) {
  for (size_t i = 0; i < n; ++i) {
    buf[i] = static_cast<T>(static_cast<int32_t>(static_cast<double>(buf[i]) / d));
  }
}

template <class T>
RR_KERNEL_CLONES void negate_wrap(T* buf, size_t n) {
  using U = std::make_unsigned_t<T>;
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(static_cast<U>(-static_cast<U>(buf[i])));
}

// ---- Type erasure: one switch on the dtype, one on the op. ----

template <class C, class Op>
void run_combine(typename C::Storage* dst, const typename C::Storage* a,
                 const typename C::Storage* b, size_t n) {
  if constexpr (std::is_same_v<C, Half>) {
    combine_half<Op>(dst, a, b, n);
  } else {
    combine<C, Op>(dst, a, b, n);
  }
}

template <class C>
void combine_op(void* dst, const void* a, const void* b, size_t n, ReduceOp op) {
  using S = typename C::Storage;
  auto* d = static_cast<S*>(dst);
  const auto* x = static_cast<const S*>(a);
  const auto* y = static_cast<const S*>(b);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: return run_combine<C, OpSum>(d, x, y, n);
    case ReduceOp::kMin: return run_combine<C, OpMin>(d, x, y, n);
    case ReduceOp::kMax: return run_combine<C, OpMax>(d, x, y, n);
    case ReduceOp::kProduct: return run_combine<C, OpProduct>(d, x, y, n);
    case ReduceOp::kAdasum: break;  // not element-wise: check_supported refused it
  }
}

void check_supported(DType dtype, ReduceOp op) {
  if (!reduce_supported(dtype, op)) {
    throw_error(ErrorKind::kInvalidArgument, "reduction ", reduce_op_name(op),
                " is not supported for dtype ", dtype_name(dtype), " (codes ",
                static_cast<int32_t>(dtype), ", ", static_cast<int32_t>(op), ")");
  }
}

void combine_any(void* dst, const void* a, const void* b, size_t n, DType dtype, ReduceOp op) {
  check_supported(dtype, op);
  if (n == 0) return;
  switch (dtype) {
    case DType::kUInt8: return combine_op<Plain<uint8_t>>(dst, a, b, n, op);
    case DType::kInt8: return combine_op<Plain<int8_t>>(dst, a, b, n, op);
    case DType::kInt32: return combine_op<Plain<int32_t>>(dst, a, b, n, op);
    case DType::kInt64: return combine_op<Plain<int64_t>>(dst, a, b, n, op);
    case DType::kFloat16: return combine_op<Half>(dst, a, b, n, op);
    case DType::kBFloat16: return combine_op<BHalf>(dst, a, b, n, op);
    case DType::kFloat32: return combine_op<Plain<float>>(dst, a, b, n, op);
    case DType::kFloat64: return combine_op<Plain<double>>(dst, a, b, n, op);
    case DType::kBool: return combine_op<Bool>(dst, a, b, n, op);
    case DType::kInt16: return combine_op<Plain<int16_t>>(dst, a, b, n, op);
    case DType::kUInt16: return combine_op<Plain<uint16_t>>(dst, a, b, n, op);
    case DType::kUInt32: return combine_op<Plain<uint32_t>>(dst, a, b, n, op);
    case DType::kUInt64: return combine_op<Plain<uint64_t>>(dst, a, b, n, op);
  }
}

template <class T>
void divide_typed(void* buf, size_t n, int64_t divisor) {
  T* p = static_cast<T*>(buf);
  if (divisor == 1) return;
  if (divisor == -1) return negate_wrap(p, n);                  // also covers MIN / -1
  if constexpr (sizeof(T) < 4 || std::is_same_v<T, int32_t>) {  // |x| < 2^31
    divide_small(p, n, static_cast<double>(divisor));
  } else {
    for (size_t i = 0; i < n; ++i) p[i] /= divisor;  // no vector integer division on x86
  }
}

[[noreturn]] void throw_bad_dtype(const char* what, DType dtype) {
  throw_error(ErrorKind::kInvalidArgument, what, " is not defined for dtype ",
              dtype_is_valid(static_cast<int32_t>(dtype)) ? dtype_name(dtype) : "<invalid>",
              " (code ", static_cast<int32_t>(dtype), ")");
}

}  // namespace

void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  combine_any(dst, dst, src, count, dtype, op);
}

void reduce_to(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  combine_any(dst, a, b, count, dtype, op);
}

void scale_inplace(void* buf, size_t count, DType dtype, double factor) {
  const auto f32 = static_cast<float>(factor);
  switch (dtype) {
    case DType::kUInt8: return scale_int(static_cast<uint8_t*>(buf), count, factor);
    case DType::kInt8: return scale_int(static_cast<int8_t*>(buf), count, factor);
    case DType::kInt32: return scale_int(static_cast<int32_t*>(buf), count, factor);
    case DType::kInt64: return scale_int(static_cast<int64_t*>(buf), count, factor);
    case DType::kFloat16: return scale_half(static_cast<uint16_t*>(buf), count, f32);
    case DType::kBFloat16: return scale_float<BHalf>(static_cast<uint16_t*>(buf), count, f32);
    case DType::kFloat32: return scale_float<Plain<float>>(static_cast<float*>(buf), count, f32);
    case DType::kFloat64:
      return scale_float<Plain<double>>(static_cast<double*>(buf), count, factor);
    case DType::kInt16: return scale_int(static_cast<int16_t*>(buf), count, factor);
    case DType::kUInt16: return scale_int(static_cast<uint16_t*>(buf), count, factor);
    case DType::kUInt32: return scale_int(static_cast<uint32_t*>(buf), count, factor);
    case DType::kUInt64: return scale_int(static_cast<uint64_t*>(buf), count, factor);
    case DType::kBool: break;
  }
  throw_bad_dtype("scale_inplace", dtype);
}

void divide_integers(void* buf, size_t count, DType dtype, int64_t divisor) {
  const bool integer = dtype_is_valid(static_cast<int32_t>(dtype)) && dtype_is_integer(dtype);
  if (!integer || dtype == DType::kBool) throw_bad_dtype("divide_integers", dtype);
  if (divisor == 0) throw_error(ErrorKind::kInvalidArgument, "divide_integers: divisor is 0");
  switch (dtype) {
    case DType::kUInt8: return divide_typed<uint8_t>(buf, count, divisor);
    case DType::kInt8: return divide_typed<int8_t>(buf, count, divisor);
    case DType::kInt32: return divide_typed<int32_t>(buf, count, divisor);
    case DType::kInt64: return divide_typed<int64_t>(buf, count, divisor);
    case DType::kInt16: return divide_typed<int16_t>(buf, count, divisor);
    case DType::kUInt16: return divide_typed<uint16_t>(buf, count, divisor);
    case DType::kUInt32: return divide_typed<uint32_t>(buf, count, divisor);
    case DType::kUInt64: return divide_typed<uint64_t>(buf, count, divisor);
    default: break;
  }
  throw_bad_dtype("divide_integers", dtype);
}

void adasum_dots(const void* a, const void* b, size_t count, DType dtype, double out[3]) {
  switch (dtype) {
    case DType::kFloat16: return adasum_dots_typed<Half>(a, b, count, out);
    case DType::kBFloat16: return adasum_dots_typed<BHalf>(a, b, count, out);
    case DType::kFloat32: return adasum_dots_typed<Plain<float>>(a, b, count, out);
    case DType::kFloat64: return adasum_dots_typed<Plain<double>>(a, b, count, out);
    default: break;
  }
  throw_bad_dtype("Adasum", dtype);
}

void adasum_scaled_add(void* dst, const void* a, const void* b, size_t count, DType dtype,
                       double ca, double cb) {
  using H = uint16_t;
  const auto fa = static_cast<float>(ca), fb = static_cast<float>(cb);
  switch (dtype) {
    case DType::kFloat16:
      return scaled_add_half(static_cast<H*>(dst), static_cast<const H*>(a),
                             static_cast<const H*>(b), count, fa, fb);
    case DType::kBFloat16:
      return scaled_add<BHalf>(static_cast<H*>(dst), static_cast<const H*>(a),
                               static_cast<const H*>(b), count, fa, fb);
    case DType::kFloat32:
      return scaled_add<Plain<float>>(static_cast<float*>(dst), static_cast<const float*>(a),
                                      static_cast<const float*>(b), count, fa, fb);
    case DType::kFloat64:
      return scaled_add<Plain<double>>(static_cast<double*>(dst), static_cast<const double*>(a),
                                       static_cast<const double*>(b), count, ca, cb);
    default: break;
  }
  throw_bad_dtype("Adasum", dtype);
}

bool reduce_supported(DType dtype, ReduceOp op) {
  if (!dtype_is_valid(static_cast<int32_t>(dtype))) return false;
  if (!reduce_op_is_valid(static_cast<int32_t>(op)) || op == ReduceOp::kAdasum) return false;
  return !(dtype == DType::kBool && op == ReduceOp::kAverage);
}

const char* reduce_isa() {
#if RR_KERNEL_X86
  // The same feature tests the target_clones resolver uses, in the same order.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "avx512";
  if (__builtin_cpu_supports("x86-64-v3")) return "avx2";
#endif
  return "baseline";
}

}  // namespace rr
