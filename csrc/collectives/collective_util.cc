#include "collectives/collective_util.h"

#include <algorithm>

#include "collectives/reduce_kernels.h"
#include "common/error.h"
#include "common/stream_copy.h"
#include "transport/progress.h"

namespace rr {

std::vector<size_t> split_offsets(size_t count, int parts) {
  std::vector<size_t> off(parts + 1, 0);
  size_t base = count / parts, extra = count % parts;
  for (int i = 0; i < parts; ++i) off[i + 1] = off[i] + base + (static_cast<size_t>(i) < extra);
  return off;
}

void ReduceSink::consume(const uint8_t* data, size_t offset, size_t n) {
  const size_t count = n / dtype_size(dtype_);
  reduce_to(dst_ + offset, own_ + offset, data, count, dtype_, op_);
  if (finalize_ranks_ > 0)
    finalize_reduction(dst_ + offset, count, dtype_, op_, postscale_, finalize_ranks_);
}

bool ReduceSink::consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                                 bool stream) {
  reduce_forward(dst_ + offset, own_ + offset, data, n, out, stream, dtype_, op_, finalize_ranks_,
                 postscale_);
  return true;
}

void reduce_forward(uint8_t* dst, const uint8_t* own, const uint8_t* src, size_t n, uint8_t* out,
                    bool stream, DType dtype, ReduceOp op, int finalize_ranks, double postscale) {
  const size_t es = dtype_size(dtype);
  for (size_t o = 0; o < n; o += kL1Block) {  // kL1Block holds whole elements of any dtype
    const size_t len = std::min(kL1Block, n - o);
    reduce_to(dst + o, own + o, src + o, len / es, dtype, op);
    if (finalize_ranks > 0)
      finalize_reduction(dst + o, len / es, dtype, op, postscale, finalize_ranks);
    copy_to(out + o, dst + o, len, stream);
  }
}

void send_recv(Context& ctx, int to, const void* sbuf, size_t sn, int from, RecvSink* sink,
               size_t rn, const std::string& what) {
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  if (to >= 0 && sn > 0)
    sends.push_back(SendOp{&ctx.link(to), static_cast<const uint8_t*>(sbuf), sn});
  if (from >= 0 && rn > 0) recvs.push_back(RecvOp{&ctx.link(from), sink, rn});
  run_transfers(ctx.progress(), sends, recvs, [&what] { return what; });
}

void apply_prescale(void* buf, size_t count, DType dtype, double prescale) {
  if (prescale != 1.0) scale_inplace(buf, count, dtype, prescale);
}

void finalize_reduction(void* buf, size_t count, DType dtype, ReduceOp op, double postscale,
                        int nranks) {
  bool average = op == ReduceOp::kAverage && nranks > 1;
  if (average && dtype_is_integer(dtype)) divide_integers(buf, count, dtype, nranks);
  // Floats fold the divisor into postscale: one pass, one rounding.
  double factor = (average && !dtype_is_integer(dtype)) ? postscale / nranks : postscale;
  if (factor != 1.0) scale_inplace(buf, count, dtype, factor);
}

void check_shape(const Context& ctx, const Tensor& t, const char* op) {
  for (int64_t d : t.shape)
    if (d < 0)
      throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": ", op, " '", t.name,
                  "': negative dimension in shape");
}

void check_reduce(const Context& ctx, const Tensor& t, ReduceOp op, const char* what) {
  check_shape(ctx, t, what);
  if (!reduce_supported(t.dtype, op))
    throw_error(
        ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": ", what, " '", t.name, "': op ",
        reduce_op_name(op), " is not supported for dtype ", dtype_name(t.dtype),
        bool(t.dtype == DType::kBool) ? " (use Sum/Max for 'any', Min/Product for 'all')" : "");
}

void check_adasum(int rank, const Tensor& t, int nranks, int device, const char* what) {
  const bool is_float = dtype_is_valid(static_cast<int32_t>(t.dtype)) && !dtype_is_integer(t.dtype);
  if (!is_float)
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank, ": ", what, " '", t.name,
                "': Adasum needs floating-point tensors (float16, bfloat16, float32, float64), ",
                "got dtype ",
                dtype_is_valid(static_cast<int32_t>(t.dtype)) ? dtype_name(t.dtype) : "<invalid>");
  if (device >= 0)
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank, ": ", what, " '", t.name,
                "': Adasum runs on host memory only; got a tensor on GPU ", device);
  if (nranks < 1 || (nranks & (nranks - 1)) != 0)
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank, ": ", what, " '", t.name,
                "': Adasum in the engine needs a power-of-two number of ranks, got ", nranks,
                " (ringreduce's Python calls gather the gradients instead for such sizes)");
}

size_t row_bytes(const Tensor& t) {
  size_t b = dtype_size(t.dtype);
  for (size_t i = 1; i < t.shape.size(); ++i) b *= static_cast<size_t>(t.shape[i]);
  return b;
}

std::vector<size_t> row_offsets_bytes(const std::vector<OpHeader>& hs, size_t rowb) {
  std::vector<size_t> off(hs.size() + 1, 0);
  for (size_t r = 0; r < hs.size(); ++r)
    off[r + 1] = off[r] + static_cast<size_t>(hs[r].ndim ? hs[r].dims[0] : 1) * rowb;
  return off;
}

void check_scales(const Context& ctx, const Tensor& t, double prescale, double postscale,
                  const char* what) {
  if (t.dtype == DType::kBool && (prescale != 1.0 || postscale != 1.0))
    throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": ", what, " '", t.name,
                "': prescale/postscale factors are not defined for dtype bool");
}

void check_has_rows(const Context& ctx, const Tensor& t, const char* what) {
  if (t.shape.empty())
    throw_error(ErrorKind::kInvalidArgument, "rank ", ctx.rank(), ": ", what, " '", t.name,
                "' needs at least one dimension (got a 0-d scalar; reshape it to [1])");
}

}  // namespace rr
