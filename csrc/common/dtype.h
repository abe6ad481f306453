// Element types and reduction operations, erased to small integers at the
// Python boundary: one binding per operation, never one per dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace rr {

// Numeric codes are part of the Python ABI (ringreduce/_dtypes.py mirrors them).
enum class DType : int32_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kFloat16 = 4,
  kBFloat16 = 5,
  kFloat32 = 6,
  kFloat64 = 7,
  kBool = 8,
  kInt16 = 9,
  kUInt16 = 10,
  kUInt32 = 11,
  kUInt64 = 12,
};

// Average is not a kernel: collectives run Sum and then divide. Adasum is not
// element-wise either: only allreduce runs it (allreduce_adasum.cc), on
// floating-point dtypes.
enum class ReduceOp : int32_t {
  kSum = 0,
  kAverage = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
  kAdasum = 5,
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);
bool dtype_is_valid(int32_t code);
bool reduce_op_is_valid(int32_t code);
bool dtype_is_integer(DType t);  // bool counts as integer here

}  // namespace rr
