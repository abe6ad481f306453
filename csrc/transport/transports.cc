#include "transport/transports.h"

#include "common/error.h"
#include "transport/context.h"

namespace rr {

// The entries' connect functions are Context members: they fill its links,
// segments and heartbeat connections.
struct TransportAccess {
  static void shm(Context& ctx, const std::vector<int>& peers) { ctx.connect_shm(peers); }
  static void tcp(Context& ctx, const std::vector<int>& peers) { ctx.connect_tcp(peers); }
};

namespace {

// Ranks with equal host ids share memory (RINGREDUCE_HOST_ID, README "Across hosts").
bool same_host(const PeerInfo& self, const PeerInfo& peer, const ContextOptions&) {
  return self.host_id == peer.host_id;
}

bool any_host(const PeerInfo&, const PeerInfo&, const ContextOptions&) {
  return true;
}

}  // namespace

const std::vector<Transport>& transport_table() {
  static const std::vector<Transport> table{
      {"shm", same_host, TransportAccess::shm, kWaitDoorbell, true},
      {"tcp", any_host, TransportAccess::tcp, kWaitFd, false},
  };
  return table;
}

std::vector<const Transport*> allowed_transports(const std::string& setting) {
  std::vector<const Transport*> out;
  std::string names = "auto";
  for (const Transport& t : transport_table()) {
    if (setting == "auto" || setting == t.name) out.push_back(&t);
    names += cat(", ", t.name);
  }
  if (out.empty())
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_TRANSPORT='", setting, "' is not one of ",
                names);
  return out;
}

}  // namespace rr
