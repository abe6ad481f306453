#include "gpu/nccl_loader.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>

#include "common/error.h"

namespace rr {
namespace gpu {
namespace {

constexpr const char* kSoname = "libnccl.so.2";

template <class Fn>
bool resolve(void* handle, const char* name, Fn*& out, std::string* missing) {
  out = reinterpret_cast<Fn*>(dlsym(handle, name));
  if (!out && missing->empty()) *missing = name;
  return out != nullptr;
}

// Every entry point of nccl::Api, or the name of the first one missing.
std::string resolve_all(void* h, nccl::Api* a) {
  std::string missing;
  resolve(h, "ncclGetVersion", a->GetVersion, &missing);
  resolve(h, "ncclGetUniqueId", a->GetUniqueId, &missing);
  resolve(h, "ncclCommInitRank", a->CommInitRank, &missing);
  resolve(h, "ncclAllReduce", a->AllReduce, &missing);
  resolve(h, "ncclBroadcast", a->Broadcast, &missing);
  resolve(h, "ncclAllGather", a->AllGather, &missing);
  resolve(h, "ncclReduceScatter", a->ReduceScatter, &missing);
  resolve(h, "ncclSend", a->Send, &missing);  // NCCL >= 2.7
  resolve(h, "ncclRecv", a->Recv, &missing);
  resolve(h, "ncclGroupStart", a->GroupStart, &missing);
  resolve(h, "ncclGroupEnd", a->GroupEnd, &missing);
  resolve(h, "ncclCommAbort", a->CommAbort, &missing);
  resolve(h, "ncclCommGetAsyncError", a->CommGetAsyncError, &missing);
  resolve(h, "ncclCommDestroy", a->CommDestroy, &missing);
  resolve(h, "ncclGetErrorString", a->GetErrorString, &missing);
  return missing;
}

std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name) {
    return map->l_name;
  }
  return fallback;
}

}  // namespace

std::shared_ptr<NcclLibrary> NcclLibrary::open(const std::vector<std::string>& dirs) {
  std::vector<std::string> candidates;
  for (const auto& d : dirs) {
    if (!d.empty()) candidates.push_back(d + "/" + kSoname);
  }
  const char* home = std::getenv("NCCL_HOME");
  if (home && *home) candidates.push_back(std::string(home) + "/lib/" + kSoname);
  candidates.push_back(kSoname);  // the dynamic loader's own search

  std::string tried;
  for (const auto& c : candidates) {
    dlerror();
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* err = dlerror();
      std::string why = err ? err : "not loadable";
      if (why.compare(0, c.size() + 2, c + ": ") == 0) why.erase(0, c.size() + 2);  // no repeat
      tried += cat("\n  ", c, ": ", why);
      continue;
    }
    std::shared_ptr<NcclLibrary> lib(new NcclLibrary());
    lib->handle_ = h;
    lib->path_ = loaded_path(h, c);
    const std::string missing = resolve_all(h, &lib->api_);
    if (!missing.empty()) {
      tried += cat("\n  ", lib->path_, ": loaded, but it has no ", missing);
      continue;  // lib's destructor closes it
    }
    const nccl::Result r = lib->api_.GetVersion(&lib->version_);
    if (r != nccl::kSuccess) {
      tried += cat("\n  ", lib->path_, ": ncclGetVersion failed: ", lib->error_string(r));
      continue;
    }
    return lib;
  }
  throw_error(ErrorKind::kInternal, "NCCL (", kSoname,
              ") could not be loaded; install it with `pip install nvidia-nccl-cu12` or set "
              "NCCL_HOME to an NCCL installation. Tried:",
              tried);
}

NcclLibrary::~NcclLibrary() {
  if (handle_) dlclose(handle_);
}

std::string NcclLibrary::error_string(nccl::Result r) const {
  const char* s = api_.GetErrorString ? api_.GetErrorString(r) : nullptr;
  return s ? cat(s, " (", r, ")") : cat("ncclResult ", r);
}

std::string nccl_version_string(int code) {
  // NCCL_VERSION(X, Y, Z): X * 1000 + Y * 100 + Z up to 2.8, X * 10000 + Y * 100 + Z since 2.9.
  if (code < 10000) return cat(code / 1000, ".", (code % 1000) / 100, ".", code % 100);
  return cat(code / 10000, ".", (code % 10000) / 100, ".", code % 100);
}

}  // namespace gpu
}  // namespace rr
