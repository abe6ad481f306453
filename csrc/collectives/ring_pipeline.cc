#include "collectives/ring_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "collectives/segments.h"
#include "common/error.h"
#include "transport/progress.h"

namespace rr {

namespace {

// The sink of a step whose next step sends the same bytes on: once that send
// has caught up with this receive and the right link has room, the step's
// sink writes its result straight into the outgoing chunk as well (NCCL's
// recvReduceCopySend), so the chunk is not read back to be sent. Not when the
// link streams its slots: forwarding with streaming stores measured slower
// (97.5 MiB rings, RINGREDUCE_SHM_STREAM_SEND=always, five alternating
// pairs: medians 18.1-23.5 ms against 16.6-22.3 ms without).
class ForwardSink : public RecvSink {
 public:
  ForwardSink(RecvSink* inner, Link* right, size_t message_bytes, size_t* sent)
      : inner_(inner), right_(right), message_bytes_(message_bytes), sent_(sent) {}

  void consume(const uint8_t* data, size_t offset, size_t n) override {
    bool stream = false;
    uint8_t* out = offset == *sent_ ? right_->claim_chunk(message_bytes_, &stream) : nullptr;
    if (out && !stream && inner_->consume_forward(data, offset, n, out, stream)) {
      right_->publish_chunk();
      *sent_ += n;
    } else {
      inner_->consume(data, offset, n);
    }
  }
  // A chunk that will be forwarded goes through consume(), not the transport.
  uint8_t* direct(size_t offset, size_t len) override {
    bool stream = false;
    if (offset == *sent_ && right_->claim_chunk(message_bytes_, &stream) && !stream) return nullptr;
    return inner_->direct(offset, len);
  }
  bool streaming() const override { return inner_->streaming(); }

 private:
  RecvSink* inner_;
  Link* right_;
  size_t message_bytes_;
  size_t* sent_;
};

class RingTask : public ProgressTask {
 public:
  RingTask(Link* left, Link* right, const std::vector<RingStep>& steps, size_t chunk,
           std::function<void()> at_mark, size_t mark)
      : left_(left),
        right_(right),
        steps_(steps),
        chunk_(chunk),
        at_mark_(std::move(at_mark)),
        mark_(mark) {}

  // A chunk at a time: a received chunk that the next step forwards goes out
  // right after it was reduced or placed, while it is still in L1/L2.
  bool advance(size_t* pending) override {
    bool moved = false;
    for (;;) {
      bool m = advance_recv();
      m |= advance_send();
      if (!m) break;
      moved = true;
    }
    *pending = (steps_.size() - rt_) + (steps_.size() - st_);
    return moved;
  }

  void pending_io(std::vector<PendingIo>* out) const override {
    out->clear();
    if (rt_ < steps_.size()) out->push_back(PendingIo{left_, false});
    if (st_ < steps_.size() && sdone_ < sendable()) out->push_back(PendingIo{right_, true});
  }

 private:
  bool advance_recv() {
    bool moved = false;
    while (rt_ < steps_.size()) {
      const RingStep& s = steps_[rt_];
      if (rdone_ < s.recv_bytes) {
        const size_t limit = std::min(s.recv_bytes, rdone_ + chunk_);
        size_t k;
        if (forwarding()) {
          ForwardSink sink(s.sink, right_, steps_[st_].send_bytes, &sdone_);
          k = left_->recv_some(sink, limit, rdone_);
        } else {
          k = left_->recv_some(*s.sink, limit, rdone_);
        }
        rdone_ += k;
        moved |= k > 0;
        if (k > 0 && rdone_ < s.recv_bytes) break;
      }
      if (rdone_ < s.recv_bytes) break;
      ++rt_;
      rdone_ = 0;
      if (rt_ == mark_ && at_mark_) at_mark_();
    }
    return moved;
  }

  // Whether the step being received feeds the step being sent (which may
  // then take chunks straight from the receive, see ForwardSink).
  bool forwarding() const {
    return gathers_ && st_ == rt_ + 1 && st_ < steps_.size() && steps_[st_].follows;
  }

  // Bytes of the current send step that may go out now.
  size_t sendable() const {
    const size_t n = steps_[st_].send_bytes;
    if (!steps_[st_].follows || rt_ >= st_) return n;
    size_t got = rt_ + 1 == st_ ? rdone_ : 0;
    return got >= n ? n : got / chunk_ * chunk_;
  }

  bool advance_send() {
    bool moved = false;
    while (st_ < steps_.size()) {
      const RingStep& s = steps_[st_];
      size_t avail = sendable();
      if (sdone_ < avail) {
        // Streaming stores follow the step's message size, as for a
        // segmented send and for the forwarding sink (not the part of it
        // released so far), so StreamChoice compares like with like.
        size_t k = s.src ? send_from_segments(s, avail)
                         : right_->send_piece(s.send + sdone_, avail - sdone_, s.send_bytes);
        sdone_ += k;
        moved |= k > 0;
      }
      if (sdone_ < s.send_bytes) break;
      ++st_;
      sdone_ = 0;
    }
    return moved;
  }

  // Sends chunk by chunk (the same framing as a contiguous send): a chunk
  // inside one region goes out in place; one spanning regions is gathered
  // into the link's slot if the link can, else staged here first. Returns the
  // bytes accepted.
  size_t send_from_segments(const RingStep& s, size_t avail) {
    size_t sent = 0;
    while (sdone_ + sent < avail) {
      const size_t pos = sdone_ + sent, start = pos / chunk_ * chunk_;
      const size_t end = std::min(start + chunk_, avail), len = end - pos;
      size_t k;
      if (const uint8_t* p = s.src->contiguous(s.src_off + pos, len))
        k = right_->send_piece(p, len, s.send_bytes);
      else if (gathers_ && pos == start)
        k = send_gathered(s, pos, len);
      else
        k = right_->send_piece(staged(s, start, end) + (pos - start), len, s.send_bytes);
      sent += k;
      if (k < len) break;
    }
    return sent;
  }

  size_t send_gathered(const RingStep& s, size_t pos, size_t len) {
    pieces_.clear();
    s.src->for_each(s.src_off + pos, len,
                    [&](uint8_t* q, size_t, size_t n) { pieces_.push_back(IoPiece{q, n}); });
    return right_->send_gather(pieces_.data(), pieces_.size(), s.send_bytes);
  }

  // Chunk [start, end) of the current step gathered into staging (kept
  // while a partial send of it is pending).
  const uint8_t* staged(const RingStep& s, size_t start, size_t end) {
    if (staged_step_ != st_ || staged_start_ != start) {
      staging_.resize(chunk_);
      s.src->for_each(s.src_off + start, end - start, [&](uint8_t* q, size_t rel, size_t n) {
        std::memcpy(staging_.data() + rel, q, n);
      });
      staged_step_ = st_;
      staged_start_ = start;
    }
    return staging_.data();
  }

  Link* left_;
  Link* right_;
  const std::vector<RingStep>& steps_;
  size_t chunk_;
  std::function<void()> at_mark_;
  size_t mark_;
  size_t rt_ = 0, rdone_ = 0;  // receive step and bytes received in it
  size_t st_ = 0, sdone_ = 0;  // send step and bytes sent in it
  bool gathers_ = right_->gathers();
  std::vector<IoPiece> pieces_;   // a chunk of a segmented send, gathered by the link
  std::vector<uint8_t> staging_;  // the same, staged for links that cannot gather
  size_t staged_step_ = SIZE_MAX, staged_start_ = 0;
};

// Bytes [base, base + n) of a larger message, seen by its sink.
class SliceSink : public RecvSink {
 public:
  SliceSink(RecvSink* inner, size_t base) : inner_(inner), base_(base) {}
  void consume(const uint8_t* data, size_t offset, size_t n) override {
    inner_->consume(data, base_ + offset, n);
  }
  uint8_t* direct(size_t offset, size_t len) override {
    return inner_->direct(base_ + offset, len);
  }
  bool streaming() const override { return inner_->streaming(); }
  bool consume_forward(const uint8_t* data, size_t offset, size_t n, uint8_t* out,
                       bool stream) override {
    return inner_->consume_forward(data, base_ + offset, n, out, stream);
  }

 private:
  RecvSink* inner_;
  size_t base_;
};

// Piece j of a step: bytes [j * slice, (j + 1) * slice) of its send and of
// its receive (either may be empty). Chained steps have equal send and
// previous-receive sizes, so the piece a step sends is the piece the step
// before it received.
RingStep slice_of(const RingStep& s, size_t j, size_t slice, std::vector<SliceSink>* sinks) {
  auto piece = [&](size_t total) { return std::min(slice, total - std::min(total, j * slice)); };
  RingStep p = s;
  p.send_bytes = piece(s.send_bytes);
  p.recv_bytes = piece(s.recv_bytes);
  if (s.send) p.send = s.send + std::min(s.send_bytes, j * slice);
  p.src_off = s.src_off + std::min(s.send_bytes, j * slice);
  if (p.recv_bytes > 0) {
    sinks->emplace_back(s.sink, j * slice);
    p.sink = &sinks->back();
  }
  p.follows = s.follows && j * slice < s.send_bytes;
  return p;
}

// The loop over slices described in ring_pipeline.h; a ring whose steps all
// fit one slice runs as given.
std::vector<RingStep> sliced_ring(const std::vector<RingStep>& steps, size_t slice,
                                  std::vector<SliceSink>* sinks) {
  size_t largest = 0;
  for (const auto& s : steps) largest = std::max({largest, s.send_bytes, s.recv_bytes});
  if (largest <= slice) return steps;
  const size_t blocks = (largest + slice - 1) / slice;
  sinks->clear();
  sinks->reserve(blocks * steps.size());
  std::vector<RingStep> out;
  out.reserve(blocks * steps.size());
  for (size_t j = 0; j < blocks; ++j)
    for (size_t t = 0; t < steps.size(); ++t) {
      out.push_back(slice_of(steps[t], j, slice, sinks));
      if (t == 0) out.back().follows = false;
    }
  return out;
}

}  // namespace

void run_ring(Context& ctx, const std::vector<RingStep>& steps, bool chained,
              const std::string& what, RingPhase phase_at) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1 || steps.empty()) return;
  std::vector<RingStep> whole = steps;
  for (size_t t = 1; chained && t < whole.size(); ++t) {
    RR_CHECK(whole[t].send_bytes == whole[t - 1].recv_bytes, what,
             ": ring step sizes are not chained");
    whole[t].follows = true;
  }
  std::vector<SliceSink> slice_sinks;
  const std::vector<RingStep> run =
      chained ? sliced_ring(whole, ctx.options().ring_slice_bytes, &slice_sinks) : whole;
  std::function<void()> mark;
  if (phase_at.name) mark = [&ctx, &phase_at] { ctx.phase(phase_at.name); };
  Link& right = ctx.link((r + 1) % n);
  RingTask task(&ctx.link((r - 1 + n) % n), &right, run, ctx.options().shm_slot_bytes,
                std::move(mark), phase_at.step);
  size_t bytes = 0;
  for (const auto& s : steps) bytes += s.send_bytes;
  const uint64_t from = ctx.options().shm_stream_send_bytes;
  const bool adaptive = from > 0 && steps[0].send_bytes >= from;
  const bool streamed = adaptive && ctx.stream_choice().pick();
  if (adaptive) right.set_streaming(streamed);
  const auto t0 = std::chrono::steady_clock::now();
  drive(ctx.progress(), task, [&what] { return what; });
  if (adaptive)
    ctx.stream_choice().report(
        streamed, static_cast<double>(bytes),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace rr
