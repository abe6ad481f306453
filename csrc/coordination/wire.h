// Byte packing for control messages between ranks of one job, in native
// layout (all ranks run the same build on the same architecture). A reader
// that runs past the end throws instead of reading garbage; the engine adds
// the peer and round to the message, so a truncated or corrupt control
// message becomes an error naming them, not a crash.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"

namespace rr {

class ByteWriter {
 public:
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void put_str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  void put_dims(const std::vector<int64_t>& d) {
    put<uint32_t>(static_cast<uint32_t>(d.size()));
    for (int64_t x : d) put<int64_t>(x);
  }
  void put_bytes(const std::vector<uint8_t>& b) {
    put<uint32_t>(static_cast<uint32_t>(b.size()));
    buf_.insert(buf_.end(), b.begin(), b.end());
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t n) : p_(data), end_(data + n) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string get_str() {
    uint32_t n = get<uint32_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  std::vector<uint8_t> get_bytes() {
    uint32_t n = get<uint32_t>();
    need(n);
    std::vector<uint8_t> b(p_, p_ + n);
    p_ += n;
    return b;
  }
  std::vector<int64_t> get_dims() {
    uint32_t n = get<uint32_t>();
    need(static_cast<size_t>(n) * 8);
    std::vector<int64_t> d(n);
    for (auto& x : d) x = get<int64_t>();
    return d;
  }
  bool at_end() const { return p_ == end_; }

 private:
  void need(size_t n) const {
    if (static_cast<size_t>(end_ - p_) < n)
      throw_error(ErrorKind::kInternal, "truncated control message");
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

}  // namespace rr
