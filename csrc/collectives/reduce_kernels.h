// Element-wise reduction and scaling kernels. Types are erased: (pointer,
// count, dtype). Kernels are deterministic: the result depends only on the
// inputs, never on the CPU's vector width, so every rank and every run gets
// the same bits. float16/bfloat16 are computed in float32 and rounded to
// nearest-even once per call.
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace rr {

// dst[i] = dst[i] (op) src[i] for i < count. op is Sum, Min, Max or Product
// (Average is Sum here). bool: Sum/Max = or, Min/Product = and.
// Throws rr::Error for an unsupported (dtype, op) pair.
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] = a[i] (op) b[i]; dst may alias a (not b unless b == a == dst).
void reduce_to(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

// buf[i] *= factor. Integers: multiply in double and round half away from
// zero, saturating to the type's range. Not defined for bool.
void scale_inplace(void* buf, size_t count, DType dtype, double factor);

// buf[i] /= divisor for integer dtypes, truncating toward zero (as C does).
void divide_integers(void* buf, size_t count, DType dtype, int64_t divisor);

// Adasum's kernels (allreduce_adasum.cc), floating-point dtypes only.
// out[0] += a.b, out[1] += a.a, out[2] += b.b over `count` elements, in double
// (elements widened exactly), in an order fixed by the count alone.
void adasum_dots(const void* a, const void* b, size_t count, DType dtype, double out[3]);
// dst[i] = ca * a[i] + cb * b[i]: float64 in double, the others in float (the
// coefficients rounded to float), one rounding to the dtype. dst may be a or b.
void adasum_scaled_add(void* dst, const void* a, const void* b, size_t count, DType dtype,
                       double ca, double cb);

// True if the element-wise kernels support (dtype, op); used to reject input
// early. Adasum is not element-wise: false (see check_adasum).
bool reduce_supported(DType dtype, ReduceOp op);

// Name of the instruction set the kernels run with here ("avx512", "avx2", "baseline").
const char* reduce_isa();

}  // namespace rr
