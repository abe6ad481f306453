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
// Invariants: messages on each link go strictly in step order; the bytes of
// step t's send that are released never exceed what step t - 1 received.
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
                          std::vector<ReduceSink>* sinks, std::vector<RingStep>* steps);
void allgather_steps(Context& ctx, uint8_t* out, const std::vector<size_t>& byte_off,
                     std::vector<CopySink>* sinks, std::vector<RingStep>* steps);

}  // namespace rr
