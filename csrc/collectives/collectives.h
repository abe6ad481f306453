// Entry points of the collectives. Each validates its input locally, then
// agrees with the other ranks through the header exchange (op_header.h),
// then runs one algorithm over the Context's links. All are blocking and
// must be called by every rank in the same order.
//
// Buffers are raw pointers plus shape and dtype: the bindings erase types.
// Outputs whose size depends on other ranks are obtained from an Allocator
// called once with the output shape, after the ranks have agreed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "transport/context.h"

namespace rr {

using Allocator = std::function<void*(const std::vector<int64_t>& shape)>;

struct Tensor {
  const void* data = nullptr;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  std::string name;
};

// out may equal in.data (in place).
void allreduce(Context& ctx, const Tensor& in, void* out, ReduceOp op, double prescale,
               double postscale);
// Concatenates along dim 0; dim 0 may differ between ranks.
void allgather(Context& ctx, const Tensor& in, const Allocator& alloc);
// In place: on root `buf` is the source, elsewhere the destination.
void broadcast(Context& ctx, void* buf, const Tensor& desc, int root);
// Reduces, then rank r keeps rows [off_r, off_r+1) of dim 0 (split as evenly as
// possible, lower ranks get the extra rows).
void reducescatter(Context& ctx, const Tensor& in, ReduceOp op, double prescale, double postscale,
                   const Allocator& alloc);
// Sends splits[r] rows of dim 0 to rank r; returns the rows received from each.
std::vector<int64_t> alltoall(Context& ctx, const Tensor& in, const std::vector<int64_t>& splits,
                              const Allocator& alloc);
void barrier(Context& ctx, const std::string& name);
// Adasum of the tensors packed in desc.data (1-d; `counts`: each tensor's
// elements, in order, the same on every rank) into `buf` (may be desc.data),
// then times postscale (callers apply prescale). Floating-point dtypes only,
// and a power-of-two ctx.size() (allreduce_adasum.cc).
void adasum(Context& ctx, void* buf, const Tensor& desc, const std::vector<size_t>& counts,
            double postscale);

class Segments;
// The tensors of a fused allreduce, reduced in place (collectives/segments.h).
// Wire-compatible with allreduce() of the same bytes packed contiguously
// (prescale 1: the caller scales its own inputs); only for totals above
// RINGREDUCE_SMALL_BYTES.
void allreduce_segments(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                        double postscale, const std::string& name);

// Shared buffers (allreduce_shared.cc). A rank's SharedKey names the shared
// region its data lies in (0: none, or less than RINGREDUCE_SHARED_MIN_BYTES)
// and digests where; it rides in the allreduce header, and allreduce_shared
// runs when every rank's is equal.
// The key also carries the rank's wish for the hierarchical algorithm, which
// runs only when every rank wishes it.
struct SharedKey {
  uint64_t region = 0;
  uint64_t layout = 0;
  uint64_t hierarchical = 0;
};
struct HeaderExchange;
SharedKey shared_key(const Context& ctx, const Segments& segs);
bool shared_agreed(const HeaderExchange& x);
bool hierarchical_agreed(const HeaderExchange& x);
// The algorithm every rank of a large allreduce runs, from the agreed headers.
enum class LargeAllreduce { kRing, kShared, kHierarchical, kSharedHierarchical };
LargeAllreduce agreed_large_allreduce(const Context& ctx, const HeaderExchange& x);
uint64_t wants_hierarchical(const Context& ctx);  // 1 if this rank wishes it
// Several hosts, one of them with several ranks (allreduce_hierarchical.cc).
bool hierarchical_applies(const Context& ctx);

// --- algorithms (one file each) ---
// `own`: this rank's contribution when it is not already in `buf` (out of place).
void allreduce_ring(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                    double postscale, const std::string& what, const uint8_t* own = nullptr);
void allreduce_ring_segments(Context& ctx, const Segments& segs, size_t count, DType dtype,
                             ReduceOp op, double postscale, const std::string& what);
void allreduce_shared(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                      double postscale, const std::string& what);
void allreduce_hierarchical(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                            double postscale, const std::string& what,
                            const uint8_t* own = nullptr);
void allreduce_hierarchical_segments(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                                     double postscale, const std::string& what);
void allreduce_shared_hierarchical(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                                   double postscale, const std::string& what);
void allreduce_adasum(Context& ctx, uint8_t* buf, const std::vector<size_t>& counts, DType dtype,
                      double postscale, const std::string& what, const uint8_t* own = nullptr);
void allreduce_direct(Context& ctx, uint8_t* buf, size_t count, DType dtype, ReduceOp op,
                      double postscale, const std::vector<std::vector<uint8_t>>& contributions);
// Leaves segment r (byte offsets seg_off) fully reduced and finalized on rank r
// (in buf; read from `own` when given, as allreduce_ring's).
void reduce_scatter_ring(Context& ctx, uint8_t* buf, const std::vector<size_t>& seg_off,
                         DType dtype, ReduceOp op, double postscale, const std::string& what,
                         const uint8_t* own = nullptr);
void allgather_ring(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                    const std::string& what);
// RINGREDUCE_HIERARCHICAL_ALLGATHER is on and hierarchical_applies().
bool hierarchical_allgather_applies(const Context& ctx);
void allgather_hierarchical(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                            const std::string& what);
void broadcast_chain(Context& ctx, uint8_t* buf, size_t bytes, int root, const std::string& what);
void alltoall_pairwise(Context& ctx, const uint8_t* in, const std::vector<size_t>& send_off,
                       uint8_t* out, const std::vector<size_t>& recv_off, const std::string& what);

}  // namespace rr
