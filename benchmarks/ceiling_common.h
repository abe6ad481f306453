/* What shared_ceiling.c and ring_ceiling.c share: a clock, a spinning two-process barrier
 * over a counter both processes map, and the fork into two ranks pinned to CPUs 0 and 1. */
#ifndef RINGREDUCE_BENCHMARKS_CEILING_COMMON_H
#define RINGREDUCE_BENCHMARKS_CEILING_COMMON_H

#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Set before fork_pinned(), in memory both ranks map (MAP_SHARED). */
static _Atomic long* arrivals;

static void barrier(long* generation) {
  long g = ++*generation;
  atomic_fetch_add(arrivals, 1);
  while (atomic_load(arrivals) < 2 * g) {
  }
}

/* Forks; returns 0 in the parent, 1 in the child, each pinned to the CPU of its rank. */
static int fork_pinned(void) {
  const pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    exit(1);
  }
  const int rank = pid == 0 ? 1 : 0;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(rank, &cpus);
  sched_setaffinity(0, sizeof cpus, &cpus);
  return rank;
}

/* Rank 0, at the end: waits for rank 1; 1 unless it exited with status 0. */
static int reap_child(void) {
  int status = 0;
  if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "rank 1 failed\n");
    return 1;
  }
  return 0;
}

#endif
