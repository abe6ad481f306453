#include "coordination/control.h"

#include <unistd.h>

#include <cstring>

#include "common/error.h"

namespace rr {

namespace {
constexpr uint32_t kCtrlMagic = 0x52524354;  // "RRCT"
}

ControlChannel::ControlChannel(Context& ctx) : ctx_(ctx), in_(ctx.size()) {}

void ControlChannel::post(int peer, CtrlType type, uint64_t round,
                          const std::vector<uint8_t>& payload) {
  auto m = std::make_unique<Outgoing>();
  std::memset(&m->header, 0, sizeof m->header);
  m->header.magic = kCtrlMagic;
  m->header.type = static_cast<uint32_t>(type);
  m->header.round = round;
  m->header.payload_bytes = payload.size();
  if (payload.size() <= kCtrlInline)
    std::memcpy(m->header.inline_payload, payload.data(), payload.size());
  else
    m->payload = payload;
  m->peer = peer;
  out_.push_back(std::move(m));
}

// Runs the queued sends (in order per link) together with `recvs`.
void ControlChannel::transfer(std::vector<RecvOp>& recvs, const Describe& what, bool wait_sends) {
  std::vector<SendOp> sends;
  for (auto& m : out_) {
    Link* l = &ctx_.link(m->peer);
    sends.push_back(SendOp{l, reinterpret_cast<const uint8_t*>(&m->header), sizeof(CtrlHeader),
                           m->header_done});
    if (!m->payload.empty())
      sends.push_back(SendOp{l, m->payload.data(), m->payload.size(), m->payload_done});
  }
  try {
    run_transfers(ctx_.progress(), sends, recvs, what, wait_sends);
  } catch (...) {
    out_.clear();
    throw;
  }
  size_t i = 0;
  std::vector<std::unique_ptr<Outgoing>> left;
  for (auto& m : out_) {
    m->header_done = sends[i++].done;
    bool complete = m->header_done == sizeof(CtrlHeader);
    if (!m->payload.empty()) {
      m->payload_done = sends[i++].done;
      complete &= m->payload_done == m->payload.size();
    }
    if (!complete) left.push_back(std::move(m));
  }
  out_ = std::move(left);
}

void ControlChannel::flush(const Describe& what) {
  std::vector<RecvOp> none;
  if (!out_.empty()) transfer(none, what, /*wait_sends=*/true);
}

bool ControlChannel::try_header(int peer) {
  Inbox& b = in_[peer];
  if (b.done < sizeof(CtrlHeader)) {
    CopySink sink(&b.header);
    b.done += ctx_.link(peer).recv_some(sink, sizeof(CtrlHeader), b.done);
  }
  return b.done > 0;
}

CtrlMessage ControlChannel::finish(int peer, std::vector<uint8_t>&& extra) {
  Inbox& b = in_[peer];
  const CtrlHeader& h = b.header;
  if (h.magic != kCtrlMagic || h.type < 1 || h.type > 3) {
    // A peer that left may have written its last words where a header was
    // due (TCP): let the link recognise them and name the real cause.
    for (int i = 0; i < 20; ++i) {
      ctx_.link(peer).check_alive();
      usleep(10000);
    }
    throw_error(ErrorKind::kInternal, "rank ", ctx_.rank(), ": garbage control message from rank ",
                peer, " (streams out of step)");
  }
  CtrlMessage m;
  m.from = peer;
  m.type = static_cast<CtrlType>(h.type);
  m.round = h.round;
  if (h.payload_bytes <= kCtrlInline)
    m.payload.assign(h.inline_payload, h.inline_payload + h.payload_bytes);
  else
    m.payload = std::move(extra);
  b.done = 0;
  return m;
}

std::vector<CtrlMessage> ControlChannel::receive(const std::vector<int>& peers,
                                                 const Describe& what) {
  std::vector<CopySink> sinks;
  sinks.reserve(peers.size());
  std::vector<RecvOp> recvs;
  for (int p : peers) {
    sinks.emplace_back(&in_[p].header);
    recvs.push_back(RecvOp{&ctx_.link(p), &sinks.back(), sizeof(CtrlHeader), in_[p].done});
  }
  transfer(recvs, what, /*wait_sends=*/false);
  for (size_t i = 0; i < peers.size(); ++i) in_[peers[i]].done = recvs[i].done;
  std::vector<std::vector<uint8_t>> extras(peers.size());
  recvs.clear();
  sinks.clear();
  for (size_t i = 0; i < peers.size(); ++i) {
    const CtrlHeader& h = in_[peers[i]].header;
    if (h.magic != kCtrlMagic || h.payload_bytes <= kCtrlInline) continue;
    if (h.payload_bytes > (1ULL << 32))
      throw_error(ErrorKind::kInternal, "rank ", ctx_.rank(), ": implausible control message of ",
                  h.payload_bytes, " bytes from rank ", peers[i]);
    extras[i].resize(h.payload_bytes);
    sinks.emplace_back(extras[i].data());
    recvs.push_back(RecvOp{&ctx_.link(peers[i]), &sinks.back(), h.payload_bytes});
  }
  if (!recvs.empty()) transfer(recvs, what, /*wait_sends=*/false);
  std::vector<CtrlMessage> out;
  for (size_t i = 0; i < peers.size(); ++i) out.push_back(finish(peers[i], std::move(extras[i])));
  return out;
}

}  // namespace rr
