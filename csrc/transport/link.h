// The one interface collectives see: a Link is a connection to one peer rank,
// carrying one message per direction at a time. Operations never block: the
// progress engine (transport/progress.h) drives many links at once and decides
// when to spin and when to sleep. Message sizes are agreed by both sides in
// advance (the collectives validate them), so links add no framing.
//
// Receive-side chunking: a message of n bytes is handed to its RecvSink in
// chunks whose offsets are multiples of the link's chunk size (a multiple of
// 64), in order. Elements of any dtype therefore never straddle two chunks,
// which lets a sink reduce directly out of transport memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/transports.h"

namespace rr {

class RecvSink {
 public:
  virtual ~RecvSink() = default;
  // Bytes [offset, offset + n) of the message have arrived at `data`.
  virtual void consume(const uint8_t* data, size_t offset, size_t n) = 0;
  // Where the transport may place bytes [offset, offset + len) itself,
  // skipping consume(); nullptr when the sink must see the bytes (e.g. it
  // reduces) or they have no single contiguous home.
  virtual uint8_t* direct(size_t /*offset*/, size_t /*len*/) { return nullptr; }
  // True if direct bytes should bypass the caches (see common/stream_copy.h).
  virtual bool streaming() const { return false; }
  // Like consume(), and also writes the bytes the sink now holds at
  // [offset, offset + n) (its result: reduced, finalized) to `out`, with
  // streaming stores if `stream`; lets a ring forward a chunk without reading
  // it back. Returns false, having done nothing, if the sink cannot.
  virtual bool consume_forward(const uint8_t* /*data*/, size_t /*offset*/, size_t /*n*/,
                               uint8_t* /*out*/, bool /*stream*/) {
    return false;
  }
};

// One piece of a gathered send.
struct IoPiece {
  const uint8_t* data;
  size_t len;
};

class Link {
 public:
  virtual ~Link() = default;
  virtual int peer() const = 0;
  // The table entry that made this link (transports.h): its name, and how a
  // waiter sleeps on it. Bound by the Context before anyone sees the link.
  const Transport& transport() const { return *transport_; }
  const char* kind() const { return transport_->name; }
  void bind(const Transport& t) { transport_ = &t; }
  virtual const std::string& peer_host() const = 0;

  // Pushes more of a message of `n` bytes of which `done` are already sent.
  // Returns how many new bytes were accepted (0 if the link is full).
  virtual size_t send_some(const uint8_t* data, size_t n, size_t done) = 0;
  // Sends the next `len` bytes of a message of `message_bytes` from `data`
  // (a message whose pieces live in different buffers, sent in link-sized
  // chunks). Returns how many bytes were accepted.
  virtual size_t send_piece(const uint8_t* data, size_t len, size_t /*message_bytes*/) {
    return send_some(data, len, 0);
  }
  // Whether send_gather and claim_chunk/publish_chunk are supported.
  virtual bool gathers() const { return false; }
  // Where the next chunk of a message of `message_bytes` may be written in
  // place (nullptr when the link is full), and whether to use streaming
  // stores; publish_chunk() sends it. Nothing is sent until then.
  virtual uint8_t* claim_chunk(size_t /*message_bytes*/, bool* /*stream*/) { return nullptr; }
  virtual void publish_chunk() {}
  // Sends the next chunk of a message of `message_bytes`, starting on a chunk
  // boundary, from `count` pieces (at most one chunk in total): all of it, or
  // nothing (returns 0) when the link is full. Spares the caller staging a
  // chunk that spans buffers.
  virtual size_t send_gather(const IoPiece* /*pieces*/, size_t /*count*/,
                             size_t /*message_bytes*/) {
    return 0;
  }
  // Delivers more of an incoming message of `n` bytes of which `done` were
  // already delivered. Returns how many new bytes were delivered.
  virtual size_t recv_some(RecvSink& sink, size_t n, size_t done) = 0;

  // Whether large sends may use streaming stores (shm only; see
  // transport/stream_choice.h). Other transports ignore it.
  virtual void set_streaming(bool /*allowed*/) {}

  // What poll() waits on when the entry waits by fd (kWaitFd).
  virtual int poll_fd() const { return -1; }
  // Throws kPeerLost if the peer is known to be gone. Called between waits.
  virtual void check_alive() = 0;
  // This rank is leaving (shutdown or unrecoverable failure): make the peer
  // notice promptly and learn `reason` (last words on the socket / wake it to
  // read our closed flag).
  virtual void abort(const std::string& reason) = 0;

 private:
  const Transport* transport_ = nullptr;
};

// A sink that copies into a contiguous destination.
class CopySink : public RecvSink {
 public:
  explicit CopySink(void* dst, bool streaming = false)
      : dst_(static_cast<uint8_t*>(dst)), streaming_(streaming) {}
  void consume(const uint8_t* data, size_t offset, size_t n) override;
  bool consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                       bool stream) override;
  uint8_t* direct(size_t offset, size_t /*len*/) override { return dst_ + offset; }
  bool streaming() const override { return streaming_; }

 private:
  uint8_t* dst_;
  bool streaming_;
};

}  // namespace rr
