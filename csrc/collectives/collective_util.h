// Pieces shared by the collective algorithms: segment arithmetic, the sink
// that reduces incoming bytes in place, a one-send-one-receive step, and the
// final scaling step of Average / postscale.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/op_header.h"
#include "common/dtype.h"
#include "common/error.h"
#include "transport/context.h"
#include "transport/link.h"

namespace rr {

// Splits `count` items into `parts` contiguous pieces whose sizes differ by at
// most one, larger pieces first. offsets has parts + 1 entries.
std::vector<size_t> split_offsets(size_t count, int parts);

// dst[offset ...] = dst[offset ...] (op) incoming, element-wise. With
// `finalize_ranks` > 0 each chunk is also finalized (Average / postscale, see
// finalize_reduction) right after its last reduction, while still in cache.
// dst = own (op) received; `own` defaults to dst (in place). An out-of-place ring
// reads this rank's contribution from the input and writes the output, so the
// output needs no copy of the input first.
class ReduceSink : public RecvSink {
 public:
  ReduceSink(void* dst, DType dtype, ReduceOp op, int finalize_ranks = 0, double postscale = 1.0,
             const void* own = nullptr)
      : dst_(static_cast<uint8_t*>(dst)),
        own_(own ? static_cast<const uint8_t*>(own) : dst_),
        dtype_(dtype),
        op_(op),
        finalize_ranks_(finalize_ranks),
        postscale_(postscale) {}
  void consume(const uint8_t* data, size_t offset, size_t n) override;
  bool consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                       bool stream) override;

 private:
  uint8_t* dst_;
  const uint8_t* own_;
  DType dtype_;
  ReduceOp op_;
  int finalize_ranks_;
  double postscale_;
};

// dst = own (op) src over n bytes (own may be dst), finalized if `finalize_ranks`
// > 0 (as ReduceSink does), and the result copied to `out` too, L1 block by L1
// block: the ring's reduce-and-forward, reading each byte once.
void reduce_forward(uint8_t* dst, const uint8_t* own, const uint8_t* src, size_t n, uint8_t* out,
                    bool stream, DType dtype, ReduceOp op, int finalize_ranks, double postscale);

// Sends `sn` bytes to rank `to` while receiving `rn` bytes from rank `from`
// into `sink`; either side may be empty (n == 0 or rank < 0).
void send_recv(Context& ctx, int to, const void* sbuf, size_t sn, int from, RecvSink* sink,
               size_t rn, const std::string& what);

// Applies prescale to a rank's own contribution (before any reduction).
void apply_prescale(void* buf, size_t count, DType dtype, double prescale);
// Turns a fully reduced buffer into the result: Average divides by `nranks`
// (integers truncate toward zero), then postscale multiplies.
void finalize_reduction(void* buf, size_t count, DType dtype, ReduceOp op, double postscale,
                        int nranks);

// Runs an entry point's body under the failure policy: transport failures,
// timeouts and internal errors mark the Context broken; mismatches and bad
// arguments do not (all ranks stopped at the same point, streams in step).
template <typename Fn>
auto guarded(Context& ctx, Fn&& fn) -> decltype(fn()) {
  ctx.check_usable();
  try {
    return fn();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kPeerLost || e.kind() == ErrorKind::kTimeout ||
        e.kind() == ErrorKind::kInternal)
      ctx.mark_broken(e.what());
    throw;
  }
}

void check_shape(const Context& ctx, const Tensor& t, const char* op);
void check_reduce(const Context& ctx, const Tensor& t, ReduceOp op, const char* what);
// Adasum: floating-point dtypes, host memory (device < 0), and a power-of-two
// number of ranks `nranks`; errors name the rank, the call and the tensor.
void check_adasum(int rank, const Tensor& t, int nranks, int device, const char* what);
// Scaling is undefined for bool: reject it before any byte moves.
void check_scales(const Context& ctx, const Tensor& t, double prescale, double postscale,
                  const char* what);
void check_has_rows(const Context& ctx, const Tensor& t, const char* what);
// alltoall: one non-negative split per rank, summing to dim 0.
void check_splits(const Context& ctx, const Tensor& in, const std::vector<int64_t>& splits);
// Bytes of one row (all dims but the first).
size_t row_bytes(const Tensor& t);
// Byte offsets of each rank's rows, from the dim 0 each rank announced.
std::vector<size_t> row_offsets_bytes(const std::vector<OpHeader>& hs, size_t rowb);

}  // namespace rr
