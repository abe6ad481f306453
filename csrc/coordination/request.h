// What ranks negotiate about. A RequestMeta is one tensor as one rank
// submitted it: everything that must agree across ranks, plus what a joined
// rank (which has no tensor of its own) needs to take part. A Response is
// the coordinator's verdict, executed by every rank in the same order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/op_header.h"
#include "common/dtype.h"
#include "coordination/wire.h"

namespace rr {

struct RequestMeta {
  CollKind kind = CollKind::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = -1;
  // -1: host memory; >= 0: this rank's GPU ordinal. Ranks agree only on host
  // vs GPU (== and compatible below): each process runs on its own GPU.
  int32_t device = -1;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;
  std::string name;
  std::string group;  // grouped_allreduce: members share it and run as one fused unit
  // Process set: the global ranks that run it, ascending (empty: every rank).
  // Readiness waits for these ranks only, and the data moves among them over
  // a group view of the Context (Context::group); rank numbers in the
  // meta (root) are positions in this list, as in Horovod.
  std::vector<int32_t> members;
  // Compression of a GPU allreduce: the DType the data travels as (float16 or
  // bfloat16, cast by the GPU executor's kernels); -1: its own dtype.
  int32_t wire = -1;

  size_t bytes() const;
  void write(ByteWriter& w) const;
  static RequestMeta read(ByteReader& r);
  // "allreduce float32[4,3] op=Sum": what a mismatch message shows per rank.
  std::string describe() const;
  int set_size(int world) const { return members.empty() ? world : int(members.size()); }
  int global_rank(int set_rank) const { return members.empty() ? set_rank : members[set_rank]; }
  bool has_rank(int rank) const;
};

std::string ranks_text(const std::vector<int32_t>& ranks);  // "[0,2]"

bool operator==(const RequestMeta& a, const RequestMeta& b);
inline bool operator!=(const RequestMeta& a, const RequestMeta& b) {
  return !(a == b);
}

// True if ranks submitting `a` and `b` under one name may run together: kind,
// dtype, op, root, scales, host-or-GPU and group agree, and the shape does (all
// dims, or all but the first for allgather / alltoall).
bool compatible(const RequestMeta& a, const RequestMeta& b);

enum class RespType : uint8_t {
  kExec = 1,          // run tensors (several = one fused allreduce)
  kError = 2,         // fail these tensors' handles on the ranks that have them
  kJoinDone = 3,      // every rank has joined; join() returns `last_joined`
  kStallWarning = 4,  // log `message` on every rank
  kFatal = 5,         // fail the engine on every rank with `message`
};

struct Response {
  RespType type = RespType::kExec;
  std::vector<RequestMeta> tensors;
  int32_t contributors = 0;  // ranks that have not joined (Average divides by this)
  int32_t last_joined = -1;
  ErrorKind error_kind = ErrorKind::kMismatch;
  std::string message;
  // Folded (engine_fold.cc): rank 0 reduced it within the round; `result`
  // holds the reduced bytes and no collective runs.
  bool folded = false;
  std::vector<uint8_t> result;
};

const char* resp_type_name(RespType t);

}  // namespace rr
