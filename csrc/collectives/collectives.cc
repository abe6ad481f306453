// Entry points: local validation, header agreement, algorithm choice, and the
// failure policy: a mismatch leaves the Context usable (every rank raised at
// the same point), while a transport failure or timeout leaves the link
// streams out of step, so the Context refuses all further work.
#include "collectives/collectives.h"

#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/op_header.h"
#include "collectives/reduce_kernels.h"
#include "collectives/segments.h"
#include "common/error.h"

namespace rr {

void allreduce(Context& ctx, const Tensor& in, void* out, ReduceOp op, double prescale,
               double postscale) {
  guarded(ctx, [&] {
    check_reduce(ctx, in, op, "allreduce");
    check_scales(ctx, in, prescale, postscale, "allreduce");
    const size_t count = static_cast<size_t>(num_elements(in.shape));
    const size_t bytes = count * dtype_size(in.dtype);
    auto* buf = static_cast<uint8_t*>(out);
    const bool small = bytes <= ctx.options().small_bytes;
    // Out of place, a large allreduce on more than one rank reads the input
    // where it is (the `own` of the ring and hierarchical algorithms);
    // everything else works on a copy in the output.
    const uint8_t* own = nullptr;
    if (out != in.data && bytes) {
      if (!small && ctx.size() > 1 && prescale == 1.0)
        own = static_cast<const uint8_t*>(in.data);
      else
        std::memcpy(buf, in.data, bytes);
    }
    apply_prescale(buf, count, in.dtype, prescale);
    OpDesc d{CollKind::kAllreduce, in.dtype, op, -1, in.shape, prescale, postscale, in.name};
    uint64_t seq = ctx.next_seq();
    Segments whole;
    whole.add(buf, bytes);
    // Peers of the shared path read the data in buf, which is not there yet out of place.
    const SharedKey key = small ? SharedKey{}
                          : own ? SharedKey{0, 0, wants_hierarchical(ctx)}
                                : shared_key(ctx, whole);
    ctx.phase("AGREE");
    HeaderExchange x = small ? exchange_headers(ctx, d, seq, buf, bytes)
                             : exchange_headers(ctx, d, seq, &key, sizeof key);
    if (small && ctx.size() > 1) ctx.phase("DIRECT");
    if (ctx.size() == 1) {
      finalize_reduction(buf, count, in.dtype, op, postscale, 1);
      return;
    }
    if (small) {
      allreduce_direct(ctx, buf, count, in.dtype, op, postscale, x.extras);
      return;
    }
    const std::string what = describe_op(d, seq);
    switch (agreed_large_allreduce(ctx, x)) {
      case LargeAllreduce::kShared:
        return allreduce_shared(ctx, whole, in.dtype, op, postscale, what);
      case LargeAllreduce::kSharedHierarchical:
        return allreduce_shared_hierarchical(ctx, whole, in.dtype, op, postscale, what);
      case LargeAllreduce::kHierarchical:
        return allreduce_hierarchical(ctx, buf, count, in.dtype, op, postscale, what, own);
      case LargeAllreduce::kRing:
        return allreduce_ring(ctx, buf, count, in.dtype, op, postscale, what, own);
    }
  });
}

// Each rank sends its block with the header when its share of the output is
// small; the direct path is used only if every rank did (all ranks see the
// same headers, so all choose alike). Otherwise the ring moves the blocks.
void allgather(Context& ctx, const Tensor& in, const Allocator& alloc) {
  guarded(ctx, [&] {
    check_shape(ctx, in, "allgather");
    check_has_rows(ctx, in, "allgather");
    const size_t rowb = row_bytes(in), mine = static_cast<size_t>(in.shape[0]) * rowb;
    OpDesc d{CollKind::kAllgather, in.dtype, ReduceOp::kSum, -1, in.shape, 1.0, 1.0, in.name};
    uint64_t seq = ctx.next_seq();
    const bool send_extra = mine * ctx.size() <= ctx.options().small_bytes;
    HeaderExchange x = exchange_headers(ctx, d, seq, in.data, send_extra ? mine : 0);
    std::vector<size_t> off = row_offsets_bytes(x.headers, rowb);
    std::vector<int64_t> shape = in.shape;
    shape[0] = 0;
    bool direct = true;
    for (int p = 0; p < ctx.size(); ++p) {
      shape[0] += x.headers[p].dims[0];
      direct &= x.headers[p].extra_bytes == off[p + 1] - off[p];
    }
    auto* out = static_cast<uint8_t*>(alloc(shape));
    for (int p = 0; p < ctx.size(); ++p) {
      const uint8_t* src = p == ctx.rank() ? static_cast<const uint8_t*>(in.data)
                                           : (direct ? x.extras[p].data() : nullptr);
      if (src && off[p + 1] > off[p]) std::memcpy(out + off[p], src, off[p + 1] - off[p]);
    }
    if (!direct) {
      if (hierarchical_allgather_applies(ctx)) {
        allgather_hierarchical(ctx, out, off, describe_op(d, seq));
      } else {
        ctx.phase("RING_ALLGATHER");
        allgather_ring(ctx, out, off, describe_op(d, seq));
      }
    }
  });
}

void broadcast(Context& ctx, void* buf, const Tensor& desc, int root) {
  guarded(ctx, [&] {
    check_shape(ctx, desc, "broadcast");
    if (root < 0 || root >= ctx.size())
      throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": broadcast '", desc.name,
                  "': root_rank ", root, " is not in [0, ", ctx.size(), ")");
    const size_t bytes = static_cast<size_t>(num_elements(desc.shape)) * dtype_size(desc.dtype);
    OpDesc d{
        CollKind::kBroadcast, desc.dtype, ReduceOp::kSum, root, desc.shape, 1.0, 1.0, desc.name};
    uint64_t seq = ctx.next_seq();
    const bool small = bytes <= ctx.options().small_bytes;
    const bool send_extra = small && ctx.rank() == root;
    HeaderExchange x = exchange_headers(ctx, d, seq, buf, send_extra ? bytes : 0);
    if (small && ctx.rank() != root && bytes) std::memcpy(buf, x.extras[root].data(), bytes);
    if (!small) ctx.phase("BROADCAST_CHAIN");
    if (!small) broadcast_chain(ctx, static_cast<uint8_t*>(buf), bytes, root, describe_op(d, seq));
  });
}

}  // namespace rr
