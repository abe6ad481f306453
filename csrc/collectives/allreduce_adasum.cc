// Adasum allreduce: Horovod's vector-halving distance-doubling algorithm
// (AdasumMPI; Maleki et al., "Scaling Distributed Training with Adaptive
// Summation", MLSys 2021). It computes the same recursive pairing as
// ringreduce/_adasum.py's adasum_tree, moving about what a ring allreduce moves.
//
// The operator, per tensor, with `a` the lower group's vector:
//   adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b,
// a coefficient staying 1 where its squared norm is below 1e-8.
//
// Protocol, for N = 2^L ranks and a buffer of T tensors packed in order
// (element boundaries `toff`, the same on every rank; the entry point checks).
// Every rank holds a range [lo, hi) of elements, at first the whole buffer.
// Level k = 0 .. L-1, distance d = 2^k, partner p = rank ^ d:
//   1. Split [lo, hi) at mid = lo + ceil((hi - lo) / 2). The lower rank of
//      the pair keeps [lo, mid), the upper one [mid, hi); each sends the
//      other half of its own vector to p and receives p's copy of the half
//      it keeps. `a` is the lower rank's data, `b` the upper one's.
//   2. For each tensor, over the part of it inside the kept half: a.b, |a|^2,
//      |b|^2 in double (adasum_dots).
//   3. The 2d ranks r with r / 2d equal (the group that holds the two full
//      vectors of this level between them, each rank a distinct part) add up
//      their 3T partial sums by recursive doubling: at step j < k + 1 the
//      ranks r and r ^ 2^j swap sums and both compute lower + upper, so every
//      member ends with bitwise the same totals.
//   4. Each rank combines its kept half per tensor from the totals
//      (adasum_scaled_add) and goes on with [lo, hi) = the kept half.
// Partners at level k agree on bits 0 .. k-1 of their ranks, which fixed
// their ranges so far: they hold the same range, so the split agrees too.
// Invariant after level k: rank r holds its part of the adasum of the
// vectors of groups {r / 2d * 2d, ...} and the one next to it, as the
// recursive pairing defines at level k + 1. After level L-1 rank r holds
// its 1/N of the result (possibly empty); it applies postscale to it.
// Allgather, distance halving: for k = L-1 .. 0 the rank swaps its range with
// rank ^ 2^k (the two ranges are the halves of the range of level k), so
// every rank ends with the whole buffer. Every element is computed by one
// rank and copied, so all ranks hold bitwise identical results.
// Each rank sends and receives (N-1)/N of the buffer in each phase, as the
// ring does, in log2(N) steps, plus L(L+1)/2 exchanges of 3T doubles.
#include <algorithm>
#include <vector>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"
#include "common/dtype.h"
#include "transport/link.h"

namespace rr {

namespace {

constexpr double kNormEps = 1e-8;  // as _adasum.py and Horovod

struct Range {
  size_t lo = 0, hi = 0;
  size_t count() const { return hi - lo; }
};

size_t mid_of(const Range& r) {
  return r.lo + (r.count() + 1) / 2;
}

// Per tensor t: sums[3t..3t+2] = a.b, |a|^2, |b|^2 over the part of tensor t
// inside `r`; a and b point at element r.lo of the two vectors.
std::vector<double> partial_dots(const uint8_t* a, const uint8_t* b, const Range& r,
                                 const std::vector<size_t>& toff, DType dtype) {
  const size_t es = dtype_size(dtype), tensors = toff.size() - 1;
  std::vector<double> sums(3 * tensors, 0.0);
  for (size_t t = 0; t < tensors; ++t) {
    const size_t lo = std::max(r.lo, toff[t]), hi = std::min(r.hi, toff[t + 1]);
    if (lo < hi)
      adasum_dots(a + (lo - r.lo) * es, b + (lo - r.lo) * es, hi - lo, dtype, &sums[3 * t]);
  }
  return sums;
}

// Step 3: sums become the totals over the 2d ranks of this rank's group.
void group_sum(Context& ctx, std::vector<double>* sums, int d, const std::string& what) {
  const size_t bytes = sums->size() * sizeof(double);
  std::vector<double> theirs(sums->size());
  for (int j = 1; j <= d; j <<= 1) {
    const int peer = ctx.rank() ^ j;
    CopySink sink(theirs.data());
    send_recv(ctx, peer, sums->data(), bytes, peer, &sink, bytes, what);
    const bool lower = (ctx.rank() & j) == 0;
    for (size_t i = 0; i < sums->size(); ++i) {
      const double mine = (*sums)[i], other = theirs[i];
      (*sums)[i] = lower ? mine + other : other + mine;
    }
  }
}

double coefficient(double dot, double norm) {
  return norm >= kNormEps ? 1.0 - dot / norm * 0.5 : 1.0;  // _adasum.adasum_combine's form
}

// Step 4: dst (the kept range in the buffer) = adasum(a, b) tensor by tensor.
void combine(uint8_t* dst, const uint8_t* a, const uint8_t* b, const Range& r,
             const std::vector<size_t>& toff, const std::vector<double>& totals, DType dtype) {
  const size_t es = dtype_size(dtype);
  for (size_t t = 0; t + 1 < toff.size(); ++t) {
    const size_t lo = std::max(r.lo, toff[t]), hi = std::min(r.hi, toff[t + 1]);
    if (lo >= hi) continue;
    const double dot = totals[3 * t], ca = coefficient(dot, totals[3 * t + 1]),
                 cb = coefficient(dot, totals[3 * t + 2]);
    const size_t o = (lo - r.lo) * es;
    adasum_scaled_add(dst + o, a + o, b + o, hi - lo, dtype, ca, cb);
  }
}

// Levels 0 .. L-1; returns the range held before each level, and the last.
// Level 0 reads this rank's vector from `own` (the input, out of place);
// every level writes only the range it keeps, so later ones read buf.
std::vector<Range> halve(Context& ctx, uint8_t* buf, const uint8_t* own,
                         const std::vector<size_t>& toff, DType dtype, const std::string& what) {
  const size_t es = dtype_size(dtype);
  const int n = ctx.size(), rank = ctx.rank();
  std::vector<Range> held;
  Range cur{0, toff.back()};
  uint8_t* recv = ctx.scratch(5, (cur.count() + 1) / 2 * es);
  const uint8_t* src = own ? own : buf;
  for (int d = 1; d < n; d <<= 1, src = buf) {
    const int peer = rank ^ d;
    const bool lower = (rank & d) == 0;
    const size_t mid = mid_of(cur);
    const Range keep = lower ? Range{cur.lo, mid} : Range{mid, cur.hi};
    const Range give = lower ? Range{mid, cur.hi} : Range{cur.lo, mid};
    CopySink sink(recv);
    send_recv(ctx, peer, src + give.lo * es, give.count() * es, peer, &sink, keep.count() * es,
              what);
    const uint8_t* mine = src + keep.lo * es;
    const uint8_t* a = lower ? mine : recv;
    const uint8_t* b = lower ? recv : mine;
    std::vector<double> sums = partial_dots(a, b, keep, toff, dtype);
    group_sum(ctx, &sums, d, what);
    combine(buf + keep.lo * es, a, b, keep, toff, sums, dtype);
    held.push_back(cur);
    cur = keep;
  }
  held.push_back(cur);
  return held;
}

}  // namespace

void allreduce_adasum(Context& ctx, uint8_t* buf, const std::vector<size_t>& counts, DType dtype,
                      double postscale, const std::string& what, const uint8_t* own) {
  const size_t es = dtype_size(dtype);
  std::vector<size_t> toff(counts.size() + 1, 0);
  for (size_t t = 0; t < counts.size(); ++t) toff[t + 1] = toff[t] + counts[t];
  const int n = ctx.size(), rank = ctx.rank();
  ctx.phase("ADASUM_VECTOR_HALVING");
  std::vector<Range> held = halve(ctx, buf, own, toff, dtype, what);
  Range cur = held.back();
  if (postscale != 1.0) scale_inplace(buf + cur.lo * es, cur.count(), dtype, postscale);
  ctx.phase("ADASUM_ALLGATHER");
  for (int d = n / 2, level = static_cast<int>(held.size()) - 2; d >= 1; d >>= 1, --level) {
    const Range parent = held[static_cast<size_t>(level)];
    const bool lower = (rank & d) == 0;  // kept the first half of `parent`
    const Range theirs = lower ? Range{cur.hi, parent.hi} : Range{parent.lo, cur.lo};
    const int peer = rank ^ d;
    CopySink sink(buf + theirs.lo * es);
    send_recv(ctx, peer, buf + cur.lo * es, cur.count() * es, peer, &sink, theirs.count() * es,
              what);
    cur = parent;
  }
}

}  // namespace rr
