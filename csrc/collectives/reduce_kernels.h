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

// True if the kernel set supports (dtype, op); used to reject input early.
bool reduce_supported(DType dtype, ReduceOp op);

// Name of the instruction set the kernels run with here ("avx512", "avx2", "baseline").
const char* reduce_isa();

}  // namespace rr
