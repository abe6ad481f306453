/* The floor for a two-rank in-place allreduce on one host: what the shared-buffer path
 * (csrc/collectives/allreduce_shared.cc) does, with nothing else around it. Two processes,
 * pinned to CPUs 0 and 1, each own a float buffer that both map; per iteration each rewrites
 * its input (untimed, as a backward pass would), then, after a barrier (every input ready):
 * rank r adds half r of both buffers and writes the sum into half r of both, barrier. No
 * engine, no negotiation, no Python: the memory traffic of the algorithm and nothing else.
 * With "two-pass" it runs the path's earlier form instead: rank r adds the peer's half r into
 * its own half r, barrier, copies the peer's reduced half into its own, barrier.
 *
 *     gcc -O3 -march=native -o /tmp/shared_ceiling benchmarks/shared_ceiling.c
 *     /tmp/shared_ceiling [floats] [two-pass]   # default: ResNet-50's 25,557,032 (97.5 MiB)
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ceiling_common.h"

int main(int argc, char** argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 25557032, bytes = n * sizeof(float);
  const int two_pass = argc > 2 && strcmp(argv[2], "two-pass") == 0;
  float* buf[2];
  for (int r = 0; r < 2; r++) {
    buf[r] = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (buf[r] == MAP_FAILED) return perror("mmap"), 1;
  }
  arrivals = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  const int rank = fork_pinned();
  float *mine = buf[rank], *peer = buf[1 - rank];
  const size_t half = n / 2, lo = rank ? half : 0, hi = rank ? n : half;
  const size_t plo = rank ? 0 : half, phi = rank ? half : n;
  long generation = 0;
  double best = 1e9, total = 0;
  const int warmup = 3, iters = 30;
  for (int it = 0; it < warmup + iters; it++) {
    for (size_t i = 0; i < n; i++) mine[i] = 1.0f;
    barrier(&generation);
    const double t0 = now();
    if (two_pass) {
      for (size_t i = lo; i < hi; i++) mine[i] += peer[i];
      barrier(&generation);
      memcpy(mine + plo, peer + plo, (phi - plo) * sizeof(float));
    } else {
      for (size_t i = lo; i < hi; i++) mine[i] = peer[i] = mine[i] + peer[i];
    }
    barrier(&generation);
    const double dt = now() - t0;
    if (it >= warmup) {
      total += dt;
      if (dt < best) best = dt;
    }
  }
  if (mine[0] != 2.0f || mine[n - 1] != 2.0f) printf("rank %d: WRONG RESULT\n", rank);
  if (rank == 0) {
    printf("%zu floats (%.1f MiB), %s: best %.2f ms, mean %.2f ms\n", n, bytes / 1048576.0,
           two_pass ? "two passes" : "one pass", best * 1e3, total / iters * 1e3);
    return reap_child();
  }
  return 0;
}
