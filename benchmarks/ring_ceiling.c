/* The floor for a two-rank in-place allreduce of *private* memory on one host: the slot
 * ring that csrc/collectives/allreduce_ring.cc runs over shm, with nothing else around it.
 * Two processes, pinned to CPUs 0 and 1, each own a private float buffer (rank r fills it
 * with r + 1, untimed, as a backward pass would). Per iteration, after a barrier:
 *
 *   rank r copies each chunk of the peer's share of its buffer into a "raw" slot;
 *   for each raw chunk the peer sent, it adds it to its own share and writes the sum
 *     both into its buffer and into a "reduced" slot (NCCL's recvReduceCopySend);
 *   for each reduced chunk the peer sent, it copies it into the peer's share of its buffer;
 *
 * all three interleaved a chunk at a time, then a barrier. Each direction has a raw and a
 * reduced FIFO of SLOTS slots: the producer may fill slot h only once the consumer has
 * released h - SLOTS (head/tail counters on their own cache lines). Shares: rank 0 owns
 * [0, n/2), rank 1 [n/2, n), so every element is reduced once, by its owner, and the result
 * is 3.0 everywhere. Compare with shared_ceiling.c (the same sum when the buffers are
 * shared, no slots): the difference is what moving data through slots costs on this VM.
 *
 * With "oop" (out of place, as rr.allreduce(x) returning a new array), each rank reads its
 * input from one private buffer and writes the result into another (allocated once, so
 * warm, as the engine's output pool hands it out): the same bytes move, over twice the
 * memory, which is what an out-of-place call cannot avoid.
 *
 * With "stream", both ranks write the slots with streaming (non-temporal) stores, so the
 * peer reads them from memory rather than from this core's cache: the other store kind
 * the engine's chooser (csrc/transport/stream_choice.h) picks between. Which is faster
 * depends on how fast a cache line moves between the two cores at the time.
 *
 *     gcc -O3 -march=native -o /tmp/ring_ceiling benchmarks/ring_ceiling.c
 *     /tmp/ring_ceiling [floats] [chunk bytes] [stream|ordinary] [oop]
 *     # default: 25,557,032 floats, 256 KiB chunks, ordinary stores, in place
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ceiling_common.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define SLOTS 4
#define BLOCK 4096 /* floats: a reduced block is still in L1 when it is copied out */

typedef struct {
  _Atomic long head; /* chunks published by the producer */
  char pad1[56];
  _Atomic long tail; /* chunks released by the consumer */
  char pad2[56];
} Fifo;

typedef struct {
  Fifo* fifo;
  float* slots;
} Channel;

typedef struct {
  size_t lo, hi, per; /* a share [lo, hi) of the buffer, in chunks of per floats */
} Share;

static size_t chunks(Share s) {
  return (s.hi - s.lo + s.per - 1) / s.per;
}
static size_t chunk_len(Share s, size_t k) {
  size_t left = s.hi - s.lo - k * s.per;
  return left < s.per ? left : s.per;
}
static float* slot(Channel c, long h, size_t per) {
  return c.slots + (size_t)(h % SLOTS) * per;
}
static int has_space(Channel c, long h) {
  return h - atomic_load_explicit(&c.fifo->tail, memory_order_acquire) < SLOTS;
}
static int has_data(Channel c, long h) {
  return atomic_load_explicit(&c.fifo->head, memory_order_acquire) > h;
}
static void publish(Channel c, long h) {
  atomic_store_explicit(&c.fifo->head, h + 1, memory_order_release);
}
static void release(Channel c, long h) {
  atomic_store_explicit(&c.fifo->tail, h + 1, memory_order_release);
}

/* memcpy of n floats; with `stream`, the 16-byte-aligned body goes with SSE2 streaming
 * stores (baseline x86-64), fenced so that a publish() after it cannot overtake them. */
static void put(float* dst, const float* src, size_t n, int stream) {
#if defined(__x86_64__)
  if (stream) {
    size_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15) != 0; i++) dst[i] = src[i];
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < n; i++) dst[i] = src[i];
    _mm_sfence();
    return;
  }
#endif
  memcpy(dst, src, n * sizeof(float));
}

/* dst = own + in, in rank order (as the engine's reductions), the sums also into `out`;
 * dst == own in place. */
static void reduce_into(float* dst, const float* own, const float* in, float* out, size_t m,
                        int rank, int stream) {
  if (stream) { /* the sums go to `out` from L1, a block at a time */
    for (size_t b = 0; b < m; b += BLOCK) {
      const size_t len = m - b < BLOCK ? m - b : BLOCK;
      reduce_into(dst + b, own + b, in + b, dst + b, len, rank, 0);
      put(out + b, dst + b, len, 1);
    }
  } else if (rank == 0) {
    for (size_t i = 0; i < m; i++) dst[i] = out[i] = own[i] + in[i];
  } else {
    for (size_t i = 0; i < m; i++) dst[i] = out[i] = in[i] + own[i];
  }
}

/* One allreduce of `src` into `buf` (the same buffer in place): `base` is the number of
 * chunks each FIFO carried in earlier iterations. */
static void ring_allreduce(const float* src, float* buf, Share own, Share peer, Channel raw_out, Channel raw_in,
                           Channel red_out, Channel red_in, long base_own, long base_peer, int rank,
                           int stream) {
  const size_t k_own = chunks(own), k_peer = chunks(peer), per = own.per;
  size_t sent = 0, reduced = 0, copied = 0;
  while (sent < k_peer || reduced < k_own || copied < k_peer) {
    if (sent < k_peer && has_space(raw_out, base_peer + sent)) {
      long h = base_peer + sent;
      put(slot(raw_out, h, per), src + peer.lo + sent * per, chunk_len(peer, sent), stream);
      publish(raw_out, h);
      sent++;
    }
    if (reduced < k_own && has_data(raw_in, base_own + reduced) &&
        has_space(red_out, base_own + reduced)) {
      long h = base_own + reduced;
      const size_t at = own.lo + reduced * per;
      reduce_into(buf + at, src + at, slot(raw_in, h, per), slot(red_out, h, per),
                  chunk_len(own, reduced), rank, stream);
      release(raw_in, h);
      publish(red_out, h);
      reduced++;
    }
    if (copied < k_peer && has_data(red_in, base_peer + copied)) {
      long h = base_peer + copied;
      memcpy(buf + peer.lo + copied * per, slot(red_in, h, per),
             chunk_len(peer, copied) * sizeof(float));
      release(red_in, h);
      copied++;
    }
  }
}

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 25557032;
  const size_t chunk = argc > 2 ? strtoull(argv[2], NULL, 10) : 262144;
  const int stream = argc > 3 && strcmp(argv[3], "stream") == 0;
  const int oop = argc > 4 && strcmp(argv[4], "oop") == 0;
  const size_t per = chunk / sizeof(float), fifo_floats = SLOTS * per;
  if (per == 0 || chunk % sizeof(float) != 0)
    return fprintf(stderr, "chunk must be a positive multiple of 4 bytes\n"), 1;
  /* fifos[dir * 2 + kind]: dir = the sending rank, kind 0 raw, 1 reduced */
  const size_t shared_bytes = 4096 + 4 * (sizeof(Fifo) + fifo_floats * sizeof(float));
  char* shared =
      mmap(NULL, shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return perror("mmap"), 1;
  arrivals = (_Atomic long*)shared;
  Fifo* fifos = (Fifo*)(shared + 4096);
  float* slots = (float*)(fifos + 4);
  /* before the fork: both ranks have them, or none */
  float* buf = malloc(n * sizeof(float));
  float* in = oop ? malloc(n * sizeof(float)) : buf;
  if (buf == NULL || in == NULL) return perror("malloc"), 1;
  const int rank = fork_pinned();
  Channel ch[4];
  for (int i = 0; i < 4; i++) ch[i] = (Channel){fifos + i, slots + i * fifo_floats};
  const int peer_rank = 1 - rank;
  Share shares[2] = {{0, n / 2, per}, {n / 2, n, per}};
  long generation = 0, base_own = 0, base_peer = 0;
  double best = 1e9, total = 0;
  const int warmup = 3, iters = 30;
  for (int it = 0; it < warmup + iters; it++) {
    for (size_t i = 0; i < n; i++) in[i] = (float)(rank + 1);
    barrier(&generation);
    const double t0 = now();
    ring_allreduce(in, buf, shares[rank], shares[peer_rank], ch[rank * 2], ch[peer_rank * 2],
                   ch[rank * 2 + 1], ch[peer_rank * 2 + 1], base_own, base_peer, rank, stream);
    barrier(&generation);
    const double dt = now() - t0;
    base_own += (long)chunks(shares[rank]);
    base_peer += (long)chunks(shares[peer_rank]);
    if (it >= warmup) {
      total += dt;
      if (dt < best) best = dt;
    }
  }
  for (size_t i = 0; i < n; i++) {
    if (buf[i] != 3.0f) {
      printf("rank %d: WRONG RESULT at %zu: %g\n", rank, i, buf[i]);
      break;
    }
  }
  if (rank == 0) {
    printf(
        "%zu floats (%.1f MiB), private ring, %s, %zu-byte chunks, %s stores: best %.2f ms, "
        "mean %.2f ms\n",
        n, n * sizeof(float) / 1048576.0, oop ? "out of place" : "in place", chunk,
        stream ? "streaming" : "ordinary", best * 1e3, total / iters * 1e3);
    return reap_child();
  }
  return 0;
}
