// Entry points of reducescatter, alltoall, barrier and Adasum (see collective_util.h
// for the failure policy they share through guarded()).
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/op_header.h"
#include "collectives/reduce_kernels.h"
#include "common/error.h"

namespace rr {

void reducescatter(Context& ctx, const Tensor& in, ReduceOp op, double prescale, double postscale,
                   const Allocator& alloc) {
  guarded(ctx, [&] {
    check_reduce(ctx, in, op, "reducescatter");
    check_scales(ctx, in, prescale, postscale, "reducescatter");
    check_has_rows(ctx, in, "reducescatter");
    const int n = ctx.size(), r = ctx.rank();
    const size_t rowb = row_bytes(in), es = dtype_size(in.dtype);
    const std::vector<size_t> rows = split_offsets(static_cast<size_t>(in.shape[0]), n);
    std::vector<size_t> off = rows;
    for (auto& o : off) o *= rowb;
    // The input must stay intact: reduce in persistent scratch.
    uint8_t* work = ctx.scratch(0, off.back());
    if (off.back()) std::memcpy(work, in.data, off.back());
    apply_prescale(work, off.back() / es, in.dtype, prescale);
    OpDesc d{CollKind::kReducescatter, in.dtype, op, -1, in.shape, prescale, postscale, in.name};
    uint64_t seq = ctx.next_seq();
    exchange_headers(ctx, d, seq, nullptr, 0);
    const size_t mine = off[r + 1] - off[r];
    if (n == 1)
      finalize_reduction(work, mine / es, in.dtype, op, postscale, 1);
    else
      reduce_scatter_ring(ctx, work, off, in.dtype, op, postscale, describe_op(d, seq));
    std::vector<int64_t> shape = in.shape;
    shape[0] = static_cast<int64_t>(rows[r + 1] - rows[r]);
    void* out = alloc(shape);
    if (mine) std::memcpy(out, work + off[r], mine);
  });
}

void check_splits(const Context& ctx, const Tensor& in, const std::vector<int64_t>& splits) {
  int64_t total = 0;
  for (int64_t s : splits) {
    if (s < 0)
      throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": alltoall '", in.name,
                  "': splits must be non-negative");
    total += s;
  }
  if (static_cast<int>(splits.size()) != ctx.size() || total != in.shape[0])
    throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": alltoall '", in.name,
                "': splits must have one entry per rank (", ctx.size(), ") summing to dim 0 (",
                in.shape[0], "); got ", splits.size(), " entries summing to ", total);
}

std::vector<int64_t> alltoall(Context& ctx, const Tensor& in, const std::vector<int64_t>& splits,
                              const Allocator& alloc) {
  return guarded(ctx, [&] {
    check_shape(ctx, in, "alltoall");
    check_has_rows(ctx, in, "alltoall");
    check_splits(ctx, in, splits);
    const int n = ctx.size(), r = ctx.rank();
    const size_t rowb = row_bytes(in);
    OpDesc d{CollKind::kAlltoall, in.dtype, ReduceOp::kSum, -1, in.shape, 1.0, 1.0, in.name};
    uint64_t seq = ctx.next_seq();
    HeaderExchange x = exchange_headers(ctx, d, seq, splits.data(), splits.size() * 8);
    std::vector<int64_t> received(n);
    std::vector<size_t> send_off(n + 1, 0), recv_off(n + 1, 0);
    for (int p = 0; p < n; ++p) {
      std::memcpy(&received[p], x.extras[p].data() + 8 * r, 8);
      send_off[p + 1] = send_off[p] + static_cast<size_t>(splits[p]) * rowb;
      recv_off[p + 1] = recv_off[p] + static_cast<size_t>(received[p]) * rowb;
    }
    std::vector<int64_t> shape = in.shape;
    shape[0] = 0;
    for (int64_t k : received) shape[0] += k;
    auto* out = static_cast<uint8_t*>(alloc(shape));
    alltoall_pairwise(ctx, static_cast<const uint8_t*>(in.data), send_off, out, recv_off,
                      describe_op(d, seq));
    return received;
  });
}

void barrier(Context& ctx, const std::string& name) {
  guarded(ctx, [&] {
    OpDesc d{CollKind::kBarrier, DType::kUInt8, ReduceOp::kSum, -1, {}, 1.0, 1.0, name};
    exchange_headers(ctx, d, ctx.next_seq(), nullptr, 0);
  });
}

// The tensor boundaries ride in the header exchange: ranks that would split
// the buffer differently raise a mismatch instead of combining the wrong parts.
void adasum(Context& ctx, void* buf, const Tensor& desc, const std::vector<size_t>& counts,
            double postscale) {
  guarded(ctx, [&] {
    check_shape(ctx, desc, "allreduce");
    check_adasum(ctx.rank(), desc, ctx.size(), -1, "allreduce");
    size_t total = 0;
    for (size_t c : counts) total += c;
    if (total != static_cast<size_t>(num_elements(desc.shape)))
      throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": allreduce '", desc.name,
                  "' (Adasum): the tensors hold ", total, " elements, the buffer ",
                  num_elements(desc.shape));
    OpDesc d{CollKind::kAllreduce, desc.dtype, ReduceOp::kAdasum, -1,
             desc.shape,           1.0,        postscale,         desc.name};
    const uint64_t seq = ctx.next_seq();
    const std::vector<uint64_t> mine(counts.begin(), counts.end());
    HeaderExchange x = exchange_headers(ctx, d, seq, mine.data(), mine.size() * sizeof(uint64_t));
    for (int p = 0; p < ctx.size(); ++p)
      if (x.extras[p] != x.extras[ctx.rank()])
        throw_error(ErrorKind::kMismatch, "rank ", ctx.rank(), ": ", describe_op(d, seq),
                    " (Adasum): rank ", ctx.global_rank(p), " splits the buffer into ",
                    x.extras[p].size() / sizeof(uint64_t), " tensors differently from rank ",
                    ctx.global_rank(ctx.rank()), "'s ", counts.size());
    ctx.count_adasum_allreduce();
    auto* b = static_cast<uint8_t*>(buf);
    const auto* own = static_cast<const uint8_t*>(desc.data);
    if (ctx.size() == 1) {
      if (own != b && total) std::memcpy(b, own, total * dtype_size(desc.dtype));
      if (postscale != 1.0) scale_inplace(b, total, desc.dtype, postscale);
      return;
    }
    allreduce_adasum(ctx, b, counts, desc.dtype, postscale, describe_op(d, seq),
                     own == b ? nullptr : own);
  });
}

}  // namespace rr
