// libnccl.so.2 opened at run time with dlopen, so one build serves machines
// with and without NCCL and needs no NCCL headers: the few types and entry
// points used are declared here, with the values of nccl.h (NCCL 2.x keeps
// them stable). Pure C++, built with and without CUDA.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace rr {
namespace gpu {

namespace nccl {

using Result = int;    // ncclResult_t
using DataType = int;  // ncclDataType_t
using RedOp = int;     // ncclRedOp_t
struct Comm;           // opaque ncclComm
using CommPtr = Comm*;
using Stream = void*;  // cudaStream_t

struct UniqueId {
  char internal[128];
};

constexpr Result kSuccess = 0;
constexpr Result kInProgress = 7;

enum : DataType {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
};

enum : RedOp { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

// The entry points, resolved by name from the loaded library.
struct Api {
  Result (*GetVersion)(int* version) = nullptr;
  Result (*GetUniqueId)(UniqueId* id) = nullptr;
  Result (*CommInitRank)(CommPtr* comm, int nranks, UniqueId id, int rank) = nullptr;
  Result (*AllReduce)(const void* send, void* recv, size_t count, DataType dtype, RedOp op,
                      CommPtr comm, Stream stream) = nullptr;
  Result (*Broadcast)(const void* send, void* recv, size_t count, DataType dtype, int root,
                      CommPtr comm, Stream stream) = nullptr;
  Result (*AllGather)(const void* send, void* recv, size_t send_count, DataType dtype, CommPtr comm,
                      Stream stream) = nullptr;
  Result (*ReduceScatter)(const void* send, void* recv, size_t recv_count, DataType dtype, RedOp op,
                          CommPtr comm, Stream stream) = nullptr;
  Result (*Send)(const void* send, size_t count, DataType dtype, int peer, CommPtr comm,
                 Stream stream) = nullptr;
  Result (*Recv)(void* recv, size_t count, DataType dtype, int peer, CommPtr comm,
                 Stream stream) = nullptr;
  Result (*GroupStart)() = nullptr;
  Result (*GroupEnd)() = nullptr;
  Result (*CommAbort)(CommPtr comm) = nullptr;
  Result (*CommGetAsyncError)(CommPtr comm, Result* async_error) = nullptr;
  Result (*CommDestroy)(CommPtr comm) = nullptr;
  const char* (*GetErrorString)(Result result) = nullptr;
};

}  // namespace nccl

// An opened libnccl.so.2 with every entry point of nccl::Api resolved. The
// handle is closed when the last owner lets go (communicators made with it
// must be destroyed first).
class NcclLibrary {
 public:
  // Tries, in order: <dir>/libnccl.so.2 for each of `dirs` (Python passes the
  // nvidia-nccl-cu12 wheel's nvidia/nccl/lib), $NCCL_HOME/lib/libnccl.so.2,
  // then plain "libnccl.so.2" (LD_LIBRARY_PATH, the ld.so cache, system
  // directories). Throws rr::Error (kInternal) listing every place tried and
  // why it failed, or which entry point a library lacks.
  static std::shared_ptr<NcclLibrary> open(const std::vector<std::string>& dirs);

  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const std::string& path() const { return path_; }  // the file loaded
  int version() const { return version_; }           // ncclGetVersion, e.g. 22703
  const nccl::Api& api() const { return api_; }
  std::string error_string(nccl::Result r) const;

 private:
  NcclLibrary() = default;
  void* handle_ = nullptr;
  std::string path_;
  int version_ = 0;
  nccl::Api api_;
};

// "2.27.3" for 22703 (and "2.8.4" for the older 2804 scheme).
std::string nccl_version_string(int code);

}  // namespace gpu
}  // namespace rr
