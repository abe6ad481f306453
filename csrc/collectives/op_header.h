// Every collective starts with a header exchange: each rank sends a fixed-size
// OpHeader to every peer, optionally followed by an "extra" message whose
// length the header announces (the data of a small allreduce, the splits of an
// alltoall). Because every rank receives every header, every rank reaches the
// same verdict: either all proceed, or all raise the same mismatch error and
// the link streams stay in step (extras are always drained).
//
// Deadlock freedom: headers go first on every link and fit in one shm slot or
// socket buffer, so phase 1 (receive all headers) always completes; phase 2
// then receives the extras while the sends continue.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "transport/context.h"

namespace rr {

enum class CollKind : uint32_t {
  kAllreduce = 1,
  kAllgather = 2,
  kBroadcast = 3,
  kReducescatter = 4,
  kAlltoall = 5,
  kBarrier = 6,
};

const char* coll_name(CollKind k);

constexpr int kMaxHeaderDims = 8;
constexpr int kMaxHeaderName = 96;
// Extras this small ride inside the header itself: a tiny allreduce or
// broadcast is then one message per peer instead of two.
constexpr size_t kInlineExtraBytes = 256;

struct OpHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
  int32_t dtype;
  int32_t op;
  int32_t root;
  int32_t ndim;
  int64_t dims[kMaxHeaderDims];
  uint64_t dims_hash;  // covers all dims, also those beyond kMaxHeaderDims
  double prescale;
  double postscale;
  uint64_t extra_bytes;  // > kInlineExtraBytes: a second message follows
  char name[kMaxHeaderName];
  uint8_t inline_extra[kInlineExtraBytes];
};

// What one rank asks for; shape is the full tensor shape.
struct OpDesc {
  CollKind kind;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  std::vector<int64_t> shape;
  double prescale = 1.0;
  double postscale = 1.0;
  std::string name;
};

// "allreduce 'grad' (#12)" for error messages.
std::string describe_op(const OpDesc& d, uint64_t seq);

struct HeaderExchange {
  std::vector<OpHeader> headers;             // by rank, ours included
  std::vector<std::vector<uint8_t>> extras;  // by rank, ours included
};

// Exchanges headers (+ extras) with all peers and checks that all ranks agree
// on what `d` requires. Throws kMismatch on every rank alike if not.
HeaderExchange exchange_headers(Context& ctx, const OpDesc& d, uint64_t seq, const void* extra,
                                uint64_t extra_bytes);

int64_t num_elements(const std::vector<int64_t>& shape);

}  // namespace rr
