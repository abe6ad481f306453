// A link to a peer on the same host through two SPSC rings: the outgoing one
// lives in the peer's segment, the incoming one in ours. A message occupies
// ceil(n / slot_bytes) consecutive slots; every message starts on a fresh slot.
// Producer: copy into slot[tail % slots], publish tail + 1, ring the peer's bell.
// Consumer: hand slot[head % slots] to the sink *in place* (reductions read
// straight out of shared memory), release head + 1, ring the peer's bell so a
// producer waiting for space wakes. Peer death is detected from its pid.
// Messages of at least `stream_send_bytes` (0 = never) are written into the
// slots with streaming stores, so the consumer reads them from memory rather
// than from the producer's cache (see RINGREDUCE_SHM_STREAM_SEND_BYTES).
#pragma once

#include <string>

#include "transport/link.h"
#include "transport/shm/shm_segment.h"

namespace rr {

class ShmLink : public Link {
 public:
  // `mine`/`theirs`: the two segments; `my_ring`/`their_ring` the ring index
  // of each side within the other's segment (its local rank).
  ShmLink(int peer, std::string host, int peer_pid, ShmSegment* mine, ShmSegment* theirs,
          uint32_t my_ring_in_theirs, uint32_t their_ring_in_mine, size_t stream_send_bytes);

  int peer() const override { return peer_; }
  const std::string& peer_host() const override { return host_; }
  size_t send_some(const uint8_t* data, size_t n, size_t done) override;
  size_t send_piece(const uint8_t* data, size_t len, size_t message_bytes) override;
  bool gathers() const override { return true; }
  size_t send_gather(const IoPiece* pieces, size_t count, size_t message_bytes) override;
  uint8_t* claim_chunk(size_t message_bytes, bool* stream) override;
  void publish_chunk() override;
  size_t recv_some(RecvSink& sink, size_t n, size_t done) override;
  void check_alive() override;
  void set_streaming(bool allowed) override { streaming_allowed_ = allowed; }
  void abort(const std::string&) override { theirs_->header()->doorbell.ring(); }

 private:
  int peer_;
  std::string host_;
  int peer_pid_;
  ShmSegment* mine_;
  ShmSegment* theirs_;
  RingHeader* out_;
  RingHeader* in_;
  uint32_t out_index_;
  uint32_t in_index_;
  uint32_t slots_;
  size_t slot_bytes_;
  size_t write_slots(const uint8_t* data, size_t n, size_t done, bool stream);
  // The next free outgoing slot, or nullptr if the ring is full.
  uint8_t* free_slot(uint32_t tail) const;
  void publish(uint32_t tail);
  size_t stream_from_;
  bool streaming_allowed_ = true;  // messages at least this large are written with streaming stores
};

}  // namespace rr
