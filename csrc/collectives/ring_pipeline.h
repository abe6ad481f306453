// The engine under every ring algorithm: a chain of steps, each sending one
// buffer region to the right neighbour and receiving one from the left.
//
// Chunk pipelining across steps: in ring algorithms the region sent at step
// t is exactly the region received at step t - 1, so the send of step t may
// start on the first chunk that step t - 1 finished receiving, instead of
// waiting for the whole step. Data is forwarded while still in cache, and
// every link stays busy from the first chunk to the last. Chunks are the
// transport's chunk size; only whole chunks (or a message's tail) are sent,
// which keeps shm slot framing aligned between sender and receiver.
//
// Slicing: a chained ring whose steps are larger than the ring slice
// (ContextOptions::ring_slice_bytes) runs as a loop over slices. Block j holds
// slice j of every step, in step order, so the message sequence on a link is
// step 0..T-1 of slice 0, then of slice 1, and so on. A received slice is then
// forwarded by the next step while it is still in cache (one step's slice is
// well under a core's L2), instead of waiting in memory until the whole
// previous step has been sent; for an allreduce of a large buffer this turns
// the allgather's re-read of each reduced segment from DRAM into a cache hit.
// Ranks must agree on the slice size (the engine checks it at start-up).
//
// Progress goes a chunk at a time (receive one, then send what may go), so a
// received chunk is forwarded right after it was reduced or placed. On links
// that can expose their outgoing chunk (shm), a chunk the next step forwards
// is written there by the receiving sink itself when the send has caught up
// (reduce into the buffer and copy out, L1 block by L1 block, see
// RecvSink::consume_forward): NCCL's recvReduceCopySend.
//
// Invariants: messages on each link go strictly in step order; the bytes of a
// following step's send that are released never exceed what the step before
// it received.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "transport/context.h"
#include "transport/link.h"

namespace rr {

class Segments;

// With `src` set, the step sends src's bytes [src_off, src_off + send_bytes)
// instead of `send` (the regions of a fused allreduce, read in place).
struct RingStep {
  const uint8_t* send = nullptr;
  size_t send_bytes = 0;
  RecvSink* sink = nullptr;
  size_t recv_bytes = 0;
  const Segments* src = nullptr;
  size_t src_off = 0;
  bool follows = false;  // sends the region the previous step received
};

// Runs the steps with rank + 1 as right and rank - 1 as left neighbour.
// If `chained`, step t > 0 sends the region step t - 1 received.
// `phase_at` (if set) is reported to the Context's phase observer once step
// `phase_at` starts receiving (e.g. the allgather half of an allreduce).
struct RingPhase {
  size_t step = SIZE_MAX;
  const char* name = nullptr;
};
void run_ring(Context& ctx, const std::vector<RingStep>& steps, bool chained,
              const std::string& what, RingPhase phase_at = {});

class ReduceSink;
class CopySink;
// Step builders, so allreduce can chain both phases in one pipeline. Sinks
// must have capacity reserved (steps point into them).
void reduce_scatter_steps(Context& ctx, uint8_t* buf, const std::vector<size_t>& seg_off,
                          DType dtype, ReduceOp op, double postscale,
                          std::vector<ReduceSink>* sinks, std::vector<RingStep>* steps,
                          const uint8_t* own = nullptr);
void allgather_steps(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                     std::vector<CopySink>* sinks, std::vector<RingStep>* steps);

}  // namespace rr
