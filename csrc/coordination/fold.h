// The arithmetic of folded and paired rounds (engine_fold.cc, engine_pair.cc):
// what a rank contributes and how contributions combine, written once so that
// every rank that combines them gets bitwise the result the collective would
// (allreduce_direct's reduction, broadcast's copy, allgather's concatenation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "coordination/request.h"

namespace rr {

// A host collective of the job (no process set, no group) that folds: an
// element-wise allreduce, a broadcast or an allgather, of at most `limit`
// bytes of this rank's tensor.
bool foldable_meta(const RequestMeta& m, size_t limit);
// The bytes of one row (dim 0) of an allgather's tensor; 0 for a scalar.
size_t allgather_row_bytes(const RequestMeta& m);
// What `rank` contributes (copied: the caller may not change an input in
// flight): an allreduce its input after prescale, as the CPU executor would
// hand it to allreduce(); a broadcast the root's buffer, the others nothing;
// an allgather its rows.
std::vector<uint8_t> fold_contribution(const Entry& e, int rank);
// Whether `bytes` is what `rank` contributes to `m`, that rank's own metadata.
bool contribution_fits(const RequestMeta& m, int rank, size_t bytes);
// The result from the contributions in rank order, `first` being rank 0's and
// `rest` ranks 1..N-1's. Allreduce: allreduce_direct's arithmetic (`first`,
// then `rest` in order, then the op's finalization: Average, postscale);
// broadcast: the root's; allgather: all of them, concatenated.
std::vector<uint8_t> fold_result(const RequestMeta& m, std::vector<uint8_t> first,
                                 const std::vector<const std::vector<uint8_t>*>& rest, int size);

}  // namespace rr
