// A link to a peer over one authenticated, non-blocking TCP socket. Bytes are
// streamed as they fit in the socket buffers. A sink that accepts bytes in
// place (copies) receives straight into its destination; a sink that needs to
// see them (reductions) gets them through a staging chunk, so the chunk
// boundaries the Link contract promises hold for TCP too.
//
// Last words: a rank that leaves writes a record (reason, its length, magic)
// and half-closes the socket. The peer keeps the last bytes it received; on
// EOF it looks for the record there, so a survivor learns *why* the peer left
// (e.g. "rank 1 has exited") instead of blaming the messenger. Best effort:
// without the record the EOF itself is still reported.
#pragma once

#include <string>
#include <vector>

#include "transport/link.h"
#include "transport/tcp/socket_util.h"

namespace rr {

class TcpLink : public Link {
 public:
  // link_timeout_s: RINGREDUCE_LINK_TIMEOUT_SECONDS (tune_data_socket).
  TcpLink(int peer, std::string host, Fd fd, size_t chunk_bytes, double link_timeout_s);

  int peer() const override { return peer_; }
  const std::string& peer_host() const override { return host_; }
  size_t send_some(const uint8_t* data, size_t n, size_t done) override;
  size_t recv_some(RecvSink& sink, size_t n, size_t done) override;
  int poll_fd() const override { return fd_.get(); }
  // Between waits: notices a peer that left while this rank only sends to it
  // (a blocked send would otherwise wait until the peer's process exits).
  void check_alive() override;
  void abort(const std::string& reason) override;

 private:
  [[noreturn]] void fail(const char* what, int err);
  void remember(const uint8_t* data, size_t n);
  std::string last_words() const;
  int peer_;
  std::string host_;
  Fd fd_;
  std::vector<uint8_t> staging_;
  size_t staged_ = 0;          // bytes of the current chunk already in staging_
  std::vector<uint8_t> tail_;  // the last bytes received, for last words
  bool aborted_ = false;
  double link_timeout_s_;
};

}  // namespace rr
