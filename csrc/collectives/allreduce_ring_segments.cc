// Ring allreduce over Segments: the same chain of 2(N-1) chunk-pipelined
// steps as allreduce_ring.cc, and the same bytes on the wire (segment split,
// chunking), so a rank running this interoperates with a rank running the
// contiguous version on a packed copy of the same tensors. Sends read the
// regions in place (a chunk that spans two regions is gathered into a
// one-chunk staging buffer by the ring); receives reduce or copy straight
// into the regions. No fusion-buffer copies in or out.
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"
#include "collectives/ring_pipeline.h"
#include "collectives/segments.h"
#include "common/stream_copy.h"

namespace rr {

void SegmentReduceSink::consume(const uint8_t* data, size_t offset, size_t n) {
  const size_t es = dtype_size(dtype_);
  segs_->for_each(base_ + offset, n, [&](uint8_t* dst, size_t rel, size_t len) {
    reduce_into(dst, data + rel, len / es, dtype_, op_);
    if (finalize_ranks_ > 0)
      finalize_reduction(dst, len / es, dtype_, op_, postscale_, finalize_ranks_);
  });
}

bool SegmentReduceSink::consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                                        bool stream) {
  segs_->for_each(base_ + offset, n, [&](uint8_t* dst, size_t rel, size_t len) {
    reduce_forward(dst, dst, data + rel, len, out + rel, stream, dtype_, op_, finalize_ranks_,
                   postscale_);
  });
  return true;
}

void SegmentCopySink::consume(const uint8_t* data, size_t offset, size_t n) {
  segs_->for_each(base_ + offset, n, [&](uint8_t* dst, size_t rel, size_t len) {
    copy_to(dst, data + rel, len, streaming_);
  });
}

bool SegmentCopySink::consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                                      bool stream) {
  segs_->for_each(base_ + offset, n, [&](uint8_t* dst, size_t rel, size_t len) {
    copy_twice(dst, streaming_, out + rel, stream, data + rel, len);
  });
  return true;
}

void allreduce_ring_segments(Context& ctx, const Segments& segs, size_t count, DType dtype,
                             ReduceOp op, double postscale, const std::string& what) {
  const int n = ctx.size(), r = ctx.rank();
  std::vector<size_t> off = split_offsets(count, n);
  for (auto& o : off) o *= dtype_size(dtype);
  auto seg = [&](int s) { return ((s % n) + n) % n; };
  std::vector<SegmentReduceSink> reduce_sinks;
  std::vector<SegmentCopySink> copy_sinks;
  reduce_sinks.reserve(n);
  copy_sinks.reserve(n);
  std::vector<RingStep> steps;
  for (int s = 0; s < n - 1; ++s) {  // reduce-scatter (see reduce_scatter_ring.cc)
    const int out = seg(r - s - 1), in = seg(r - s - 2);
    reduce_sinks.emplace_back(&segs, off[in], dtype, op, s == n - 2 ? n : 0, postscale);
    steps.push_back(RingStep{nullptr, off[out + 1] - off[out], &reduce_sinks.back(),
                             off[in + 1] - off[in], &segs, off[out]});
  }
  const bool streaming = segs.bytes() >= ctx.options().streaming_bytes;
  for (int s = 0; s < n - 1; ++s) {  // allgather (see allgather_ring.cc)
    const int send_b = seg(r - s), recv_b = seg(r - s - 1);
    copy_sinks.emplace_back(&segs, off[recv_b], streaming);
    steps.push_back(RingStep{nullptr, off[send_b + 1] - off[send_b], &copy_sinks.back(),
                             off[recv_b + 1] - off[recv_b], &segs, off[send_b]});
  }
  ctx.phase("RING_REDUCE_SCATTER");
  run_ring(ctx, steps, /*chained=*/true, what,
           RingPhase{static_cast<size_t>(n - 1), "RING_ALLGATHER"});
}

void allreduce_segments(Context& ctx, const Segments& segs, DType dtype, ReduceOp op,
                        double postscale, const std::string& name) {
  guarded(ctx, [&] {
    const size_t es = dtype_size(dtype), count = segs.bytes() / es;
    OpDesc d{CollKind::kAllreduce,          dtype, op,        -1,
             {static_cast<int64_t>(count)}, 1.0,   postscale, name};
    const uint64_t seq = ctx.next_seq();
    RR_CHECK(segs.bytes() > ctx.options().small_bytes || ctx.size() == 1, describe_op(d, seq),
             ": segmented allreduce below the small-message size");
    const SharedKey key = shared_key(ctx, segs);
    ctx.phase("AGREE");
    HeaderExchange x = exchange_headers(ctx, d, seq, &key, sizeof key);
    if (ctx.size() == 1) {
      segs.for_each(0, segs.bytes(), [&](uint8_t* p, size_t, size_t len) {
        finalize_reduction(p, len / es, dtype, op, postscale, 1);
      });
      return;
    }
    const std::string what = describe_op(d, seq);
    switch (agreed_large_allreduce(ctx, x)) {
      case LargeAllreduce::kShared: return allreduce_shared(ctx, segs, dtype, op, postscale, what);
      case LargeAllreduce::kSharedHierarchical:
        return allreduce_shared_hierarchical(ctx, segs, dtype, op, postscale, what);
      case LargeAllreduce::kHierarchical:
        return allreduce_hierarchical_segments(ctx, segs, dtype, op, postscale, what);
      case LargeAllreduce::kRing:
        return allreduce_ring_segments(ctx, segs, count, dtype, op, postscale, what);
    }
  });
}

}  // namespace rr
