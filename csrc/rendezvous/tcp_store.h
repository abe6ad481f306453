// Rendezvous over TCP for ranks in different processes or on different hosts:
// one process runs a TcpStoreServer (typically the launcher or rank 0) and
// every rank reaches it through a TcpStoreClient. The wire protocol is
// documented in tcp_store.cc.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "rendezvous/store.h"

namespace rr {

// Serves the store from one background thread that multiplexes the listening
// socket and every client with poll(), so thousands of ranks cost one thread.
// A GET for a missing key is parked on the server until a SET supplies it.
// Clients that disconnect or send malformed data are dropped with a warning;
// they never affect other clients.
class TcpStoreServer {
 public:
  // bind_host "" or "0.0.0.0" listens on all IPv4 interfaces; port 0 picks a
  // free port (see port()). Throws kInternal if the socket cannot be bound.
  TcpStoreServer(const std::string& bind_host, int port);
  ~TcpStoreServer();  // same as close()
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }  // the bound port, also when 0 was requested

  // Stops the thread and closes every connection, so connected clients see
  // kPeerLost. Idempotent and safe to call from any thread.
  void close();

 private:
  class Loop;  // the poll loop and all connection state; lives in tcp_store.cc

  std::unique_ptr<Loop> loop_;
  int port_ = 0;
  int wake_fd_ = -1;  // write end of the pipe that tells the loop to exit
  std::thread thread_;
  std::mutex close_mu_;
};

// A client connection to a TcpStoreServer.
// Calls on one client are serialized: a get() that waits for a key blocks
// other calls on the same client, so a thread that waits for a key must not
// share its client with the thread expected to set it.
// After a timeout or a lost connection the socket is dropped (the server
// would otherwise answer the abandoned request later) and the next call
// reconnects, retrying for up to connect_timeout_s; a refused reconnect
// raises kPeerLost at once, since the server was up before.
class TcpStoreClient : public Store {
 public:
  // Connects, retrying until connect_timeout_s passes, because launchers
  // start all ranks at once and the server may come up after its clients.
  // Throws kTimeout if no connection could be made in time.
  TcpStoreClient(const std::string& host, int port, double connect_timeout_s);
  ~TcpStoreClient() override;
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  // Waits for the server's acknowledgement; connect_timeout_s bounds the wait.
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_s) override;
  std::string add(const std::string& key, const std::string& value) override;

 private:
  // reconnect_for is null for the first connection, else what the caller was
  // doing (for messages): then failing to reconnect means kPeerLost.
  void connect_until(std::chrono::steady_clock::time_point deadline,
                     const std::string* reconnect_for);
  void ensure_connected(const std::string& what);
  void disconnect();
  std::string read_value(std::chrono::steady_clock::time_point deadline, const std::string& what);
  std::string endpoint() const;  // "host:port" for messages

  const std::string host_;
  const int port_;
  const double connect_timeout_s_;
  std::mutex mu_;
  int fd_ = -1;
};

}  // namespace rr
