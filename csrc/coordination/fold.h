// The arithmetic of folded and paired rounds (engine_fold.cc, engine_pair.cc):
// what a rank contributes and how contributions combine, written once so that
// every rank that reduces them gets bitwise the result allreduce_direct would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "coordination/request.h"

namespace rr {

// A host allreduce of the job, element-wise, of at most `limit` bytes.
bool foldable_meta(const RequestMeta& m, size_t limit);
// The input after prescale, as the CPU executor would hand it to allreduce()
// (copied: the caller may not change an input in flight).
std::vector<uint8_t> fold_contribution(const Entry& e);
// allreduce_direct's arithmetic: `acc` (rank 0's contribution), then `rest`
// (ranks 1..N-1) in rank order, then the op's finalization (Average, postscale).
std::vector<uint8_t> fold_reduce(const RequestMeta& m, std::vector<uint8_t> acc,
                                 const std::vector<const std::vector<uint8_t>*>& rest, int size);

}  // namespace rr
