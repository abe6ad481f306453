#include "common/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace rr {

void stream_copy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  // Align the destination to 16 bytes with a plain copy; SSE2 is baseline x86-64.
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t body = n & ~static_cast<size_t>(63);
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  _mm_sfence();  // order the streaming stores before anything published after
  std::memcpy(d + body, s + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void copy_to(void* dst, const void* src, size_t n, bool stream) {
  if (stream)
    stream_copy(dst, src, n);
  else
    std::memcpy(dst, src, n);
}

void copy_twice(void* a, bool stream_a, void* b, bool stream_b, const void* src, size_t n) {
  auto* pa = static_cast<uint8_t*>(a);
  auto* pb = static_cast<uint8_t*>(b);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t o = 0; o < n; o += kL1Block) {
    const size_t len = n - o < kL1Block ? n - o : kL1Block;
    copy_to(pa + o, s + o, len, stream_a);
    copy_to(pb + o, s + o, len, stream_b);
  }
}

}  // namespace rr
