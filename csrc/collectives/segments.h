// A buffer made of several disjoint regions laid end to end: the tensors of
// a fused allreduce, reduced where they are instead of being copied into a
// fusion buffer and back. Offsets are positions in the concatenation. All
// regions hold the same dtype and whole elements, so an element never spans
// two regions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "transport/link.h"

namespace rr {

class Segments {
 public:
  void add(uint8_t* p, size_t n) {
    if (n == 0) return;
    ptrs_.push_back(p);
    offs_.push_back(total_);
    total_ += n;
  }
  size_t bytes() const { return total_; }

  // Calls fn(ptr, rel, len) for each piece of [off, off + n), where rel is
  // the piece's position within the range.
  template <typename Fn>
  void for_each(size_t off, size_t n, Fn&& fn) const {
    if (n == 0) return;
    size_t i = std::upper_bound(offs_.begin(), offs_.end(), off) - offs_.begin() - 1;
    for (size_t done = 0; done < n; ++i) {
      const size_t end = i + 1 < offs_.size() ? offs_[i + 1] : total_;
      const size_t len = std::min(n - done, end - (off + done));
      fn(ptrs_[i] + (off + done - offs_[i]), done, len);
      done += len;
    }
  }
  // [off, off + n) as one pointer if it lies in one region, else nullptr.
  uint8_t* contiguous(size_t off, size_t n) const {
    uint8_t* p = nullptr;
    size_t pieces = 0;
    for_each(off, n, [&](uint8_t* q, size_t, size_t) {
      p = q;
      ++pieces;
    });
    return pieces == 1 ? p : nullptr;
  }

 private:
  std::vector<uint8_t*> ptrs_;
  std::vector<size_t> offs_;
  size_t total_ = 0;
};

// Reduces incoming bytes into the regions (finalizing them when asked, as
// ReduceSink does for a contiguous buffer).
class SegmentReduceSink : public RecvSink {
 public:
  SegmentReduceSink(const Segments* segs, size_t base, DType dtype, ReduceOp op, int finalize_ranks,
                    double postscale)
      : segs_(segs),
        base_(base),
        dtype_(dtype),
        op_(op),
        finalize_ranks_(finalize_ranks),
        postscale_(postscale) {}
  void consume(const uint8_t* data, size_t offset, size_t n) override;
  bool consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                       bool stream) override;

 private:
  const Segments* segs_;
  size_t base_;
  DType dtype_;
  ReduceOp op_;
  int finalize_ranks_;
  double postscale_;
};

// Copies incoming bytes into the regions; a chunk that lands inside one
// region is placed there by the transport directly (with streaming stores for
// large outputs, as CopySink does), only a chunk spanning regions is split.
class SegmentCopySink : public RecvSink {
 public:
  SegmentCopySink(const Segments* segs, size_t base, bool streaming)
      : segs_(segs), base_(base), streaming_(streaming) {}
  void consume(const uint8_t* data, size_t offset, size_t n) override;
  bool consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                       bool stream) override;
  uint8_t* direct(size_t offset, size_t len) override {
    return segs_->contiguous(base_ + offset, len);
  }
  bool streaming() const override { return streaming_; }

 private:
  const Segments* segs_;
  size_t base_;
  bool streaming_;
};

}  // namespace rr
