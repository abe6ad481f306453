#include "transport/shm/shm_link.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/error.h"
#include "common/stream_copy.h"

namespace rr {

ShmLink::ShmLink(int peer, std::string host, int peer_pid, ShmSegment* mine, ShmSegment* theirs,
                 uint32_t my_ring_in_theirs, uint32_t their_ring_in_mine, size_t stream_send_bytes)
    : peer_(peer),
      host_(std::move(host)),
      peer_pid_(peer_pid),
      mine_(mine),
      theirs_(theirs),
      out_(theirs->ring(my_ring_in_theirs)),
      in_(mine->ring(their_ring_in_mine)),
      out_index_(my_ring_in_theirs),
      in_index_(their_ring_in_mine),
      slots_(mine->header()->slots),
      slot_bytes_(mine->header()->slot_bytes),
      stream_from_(stream_send_bytes ? stream_send_bytes : SIZE_MAX) {
  RR_CHECK(theirs->header()->slots == slots_ && theirs->header()->slot_bytes == slot_bytes_,
           "rank ", peer, " uses different shared-memory ring settings (RINGREDUCE_SHM_SLOTS / ",
           "RINGREDUCE_SHM_SLOT_BYTES must be equal on all ranks)");
}

size_t ShmLink::send_some(const uint8_t* data, size_t n, size_t done) {
  return write_slots(data, n, done, streaming_allowed_ && n >= stream_from_);
}

// The streaming decision follows the whole message, not the piece.
size_t ShmLink::send_piece(const uint8_t* data, size_t len, size_t message_bytes) {
  return write_slots(data, len, 0, streaming_allowed_ && message_bytes >= stream_from_);
}

uint8_t* ShmLink::free_slot(uint32_t tail) const {
  const uint32_t head = out_->head.load(std::memory_order_acquire);
  return tail - head >= slots_ ? nullptr : theirs_->slot(out_index_, tail % slots_);
}

void ShmLink::publish(uint32_t tail) {
  out_->tail.store(tail);  // seq_cst: pairs with the doorbell protocol
}

size_t ShmLink::write_slots(const uint8_t* data, size_t n, size_t done, bool stream) {
  size_t start = done;
  uint32_t tail = out_->tail.load(std::memory_order_relaxed);
  while (done < n) {
    uint8_t* slot = free_slot(tail);
    if (!slot) break;
    size_t len = std::min(slot_bytes_, n - done);
    copy_to(slot, data + done, len, stream);
    publish(++tail);
    done += len;
  }
  if (done != start) theirs_->header()->doorbell.ring();
  return done - start;
}

uint8_t* ShmLink::claim_chunk(size_t message_bytes, bool* stream) {
  *stream = streaming_allowed_ && message_bytes >= stream_from_;
  return free_slot(out_->tail.load(std::memory_order_relaxed));
}

void ShmLink::publish_chunk() {
  publish(out_->tail.load(std::memory_order_relaxed) + 1);
  theirs_->header()->doorbell.ring();
}

size_t ShmLink::send_gather(const IoPiece* pieces, size_t count, size_t message_bytes) {
  uint32_t tail = out_->tail.load(std::memory_order_relaxed);
  uint8_t* slot = free_slot(tail);
  if (!slot) return 0;
  const bool stream = streaming_allowed_ && message_bytes >= stream_from_;
  size_t off = 0;
  for (size_t i = 0; i < count; ++i) {
    RR_CHECK(off + pieces[i].len <= slot_bytes_, "send_gather: more than one slot");
    copy_to(slot + off, pieces[i].data, pieces[i].len, stream);
    off += pieces[i].len;
  }
  publish(++tail);
  theirs_->header()->doorbell.ring();
  return off;
}

size_t ShmLink::recv_some(RecvSink& sink, size_t n, size_t done) {
  size_t start = done;
  uint32_t head = in_->head.load(std::memory_order_relaxed);
  while (done < n) {
    uint32_t tail = in_->tail.load();
    if (head == tail) break;
    size_t len = std::min(slot_bytes_, n - done);
    const uint8_t* src = mine_->slot(in_index_, head % slots_);
    if (uint8_t* dst = sink.direct(done, len))
      copy_to(dst, src, len, sink.streaming());
    else
      sink.consume(src, done, len);
    ++head;
    in_->head.store(head);
    done += len;
    // Wake a producer blocked on a full ring as soon as a slot frees up.
    theirs_->header()->doorbell.ring();
  }
  return done - start;
}

void ShmLink::check_alive() {
  std::string why = theirs_->closed_reason();
  if (!why.empty())
    throw_error(ErrorKind::kPeerLost, "rank ", peer_, " on host ", host_, " left the job: ", why);
  if (!process_alive(peer_pid_))
    throw_error(ErrorKind::kPeerLost, "rank ", peer_, " (pid ", peer_pid_, " on host ", host_,
                ") has exited");
}

}  // namespace rr
