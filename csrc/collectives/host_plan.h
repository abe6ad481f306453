// How the hierarchical allreduces (allreduce_hierarchical.cc,
// allreduce_shared_hierarchical.cc) cut a buffer among hosts and ranks.
// Hosts h = 0 .. H-1 (in order of their lowest rank) hold L_h ranks;
// S = max L_h. The buffer is cut into S shards (split_offsets: sizes differ by
// at most one element). On host h, local rank l owns the contiguous shard
// range [a_h(l), a_h(l+1)) with a_h = split_offsets(S, L_h), so every shard
// has exactly one owner per host. Every rank derives the same plan from the
// Context's topology, without talking.
#pragma once

#include <cstddef>
#include <vector>

#include "common/dtype.h"
#include "transport/context.h"

namespace rr {

struct HostPlan {
  std::vector<std::vector<int>> hosts;  // global ranks per host
  std::vector<size_t> shard_off;        // byte offsets of the S shards
  int my_host = -1, my_local = -1;

  int shards() const { return static_cast<int>(shard_off.size()) - 1; }
  // First shard owned by local rank l on host h (l == L_h: one past the last).
  size_t first_shard(int h, int l) const;
  // The global rank that owns `shard` on host h.
  int owner(int h, size_t shard) const;
  // The owners of `shard`, one per host, hosts in order: that shard's ring.
  std::vector<int> ring(size_t shard) const;
  // This host's ranks and the shard range [first, last) this rank owns.
  const std::vector<int>& my_ranks() const { return hosts[my_host]; }
  size_t my_first() const { return first_shard(my_host, my_local); }
  size_t my_last() const { return first_shard(my_host, my_local + 1); }
};

HostPlan plan_hosts(const Context& ctx, size_t count, size_t elem_bytes);

// The op of the phases before the last: an Average sums, and divides once at the end.
inline ReduceOp partial_op(ReduceOp op) {
  return op == ReduceOp::kAverage ? ReduceOp::kSum : op;
}

}  // namespace rr
