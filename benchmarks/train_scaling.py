"""Training throughput and scaling efficiency: ringreduce.torch vs torch DDP (gloo).

    python benchmarks/train_scaling.py [--steps 6] [--batch 32] [--nps 1 2] [--threads 1 0]

Trains a ResNet-18-style CNN (11.2 M parameters, 32x32 inputs, synthetic data)
with SGD, one torch thread per rank (``--threads``: a list; 0 = torch's default thread
count, every rank then competing with the others and the engine for the cores), and
reports samples/s at each -np for
ringreduce.torch.DistributedOptimizer (with its gradient buckets, the default, and
without: ``rr-no-buckets``) and torch.nn.parallel.DistributedDataParallel over gloo, all
in the same run (each launch is a fresh set of processes, started
torchrun-style with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, which both libraries
understand). Scaling efficiency = thr(N) / (N * thr(1)).

Each launch prints where rank 0's steps went: forward+backward vs ``opt.step()`` (for
ringreduce the wait for the averages; DDP waits inside backward), CPU time per step of the
main thread, the engine thread (``rr-engine``) and the other threads (torch's intra-op
threads, gloo's), involuntary context switches, and negotiation rounds per step.
``--variant LABEL=BACKEND:K=V,...`` adds a row running BACKEND with extra environment
variables (``--variant spin0=ringreduce:RINGREDUCE_SPIN_US=0``). The table gives the median
and min-max over ``--repeats`` launches.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

BACKENDS = ("ringreduce", "rr-no-buckets", "ddp")


# --------------------------------------------------------------------- model
def make_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.skip = nn.Sequential()
            if stride != 1 or cin != cout:
                self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.skip(x))

    layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


# -------------------------------------------------------------------- worker
def worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = make_model()
    stats = None
    if args.worker in ("ringreduce", "rr-no-buckets"):
        import ringreduce
        import ringreduce.torch as rr

        def stats():
            return ringreduce._comm()._engine.stats()

        rr.init()
        rank, size, barrier = rr.rank(), rr.size(), rr.barrier
        opt = rr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                      momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      gradient_buckets=args.worker == "ringreduce")
        rr.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    phases = {"backward_s": 0.0, "step_s": 0.0}

    def step():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()  # ringreduce: waits for the averages; DDP: averaged during backward
        phases["backward_s"] += t1 - t0
        phases["step_s"] += time.perf_counter() - t1

    for _ in range(args.warmup):
        step()
    barrier()
    before = stats() if stats else None
    cpu0, phases["backward_s"], phases["step_s"] = thread_cpu(), 0.0, 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    barrier()
    elapsed = time.perf_counter() - start
    cpu = {k: (v - cpu0.get(k, 0.0)) / args.steps for k, v in thread_cpu().items()}
    # Negotiation rounds per step: each is a synchronisation of the ranks, which costs
    # scheduling delays when compute threads hold every core.
    rounds = (stats()["rounds"] - before["rounds"]) / args.steps if stats else None
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"backend": args.worker, "np": size, "params": params,
                          "threads": torch.get_num_threads(),
                          "step_s": elapsed / args.steps,
                          "samples_per_s": size * args.batch * args.steps / elapsed,
                          "rounds_per_step": rounds,
                          "backward_ms": 1e3 * phases["backward_s"] / args.steps,
                          "opt_step_ms": 1e3 * phases["step_s"] / args.steps,
                          **{(f"{k}_per_step" if "csw" in k else f"cpu_{k}_ms"):
                             v if "csw" in k else 1e3 * v for k, v in cpu.items()}}),
              flush=True)


def thread_cpu() -> dict:
    """CPU seconds (user + system) of this process's threads, by kind.

    Returns
    -------
    dict
        ``main`` (the training loop's thread), ``engine`` (ringreduce's engine thread,
        named ``rr-engine``), ``other`` (torch's intra-op threads, gloo's, ...) and
        ``nvcsw`` / ``nivcsw``: the process's voluntary and involuntary context switches.
    """
    tick = os.sysconf("SC_CLK_TCK")
    out = {"main": 0.0, "engine": 0.0, "other": 0.0, "nivcsw": 0.0, "nvcsw": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        kind = ("main" if int(tid) == os.getpid() else
                "engine" if name == "rr-engine" else "other")
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
        out["nvcsw"] += int(status["voluntary_ctxt_switches"])
        out["nivcsw"] += int(status["nonvoluntary_ctxt_switches"])
    return out


# -------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(backend: str, n: int, threads: int, args, env_extra: dict | None = None) -> dict:
    """Start n worker processes torchrun-style; return rank 0's result."""
    port = free_port()
    procs = []
    for r in range(n):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env_extra or {})}
        env.pop("OMP_NUM_THREADS", None)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, __file__, "--worker", backend, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--threads", str(threads)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"{backend} at -np {n} failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def parse_variant(text: str) -> tuple[str, str, dict]:
    """Parse ``LABEL=BACKEND:K=V,K=V`` into (label, backend, env).

    E.g. ``spin0=ringreduce:RINGREDUCE_SPIN_US=0``.
    """
    label, _, rest = text.partition("=")
    backend, _, assigns = rest.partition(":")
    if not label or backend not in BACKENDS:
        raise SystemExit(f"--variant {text!r}: expected LABEL=BACKEND:K=V,... with BACKEND in "
                         f"{BACKENDS}")
    env = dict(a.split("=", 1) for a in assigns.split(",") if a)
    return label, backend, env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=6, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--nps", type=int, nargs="+", default=[1, 2], help="process counts")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="torch threads per rank, one configuration each (0: torch's default)")
    p.add_argument("--repeats", type=int, default=2,
                   help="launches per configuration, interleaved (median, min-max reported)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL=BACKEND:K=V,... an extra row: BACKEND run with these env vars")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    args = p.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        return worker(args)
    rows = [(b, b, {}) for b in args.backends] + [parse_variant(v) for v in args.variant]
    results: dict = {}
    for k in range(args.repeats):  # interleaved, so a noisy stretch hits every configuration
        for t in args.threads:
            for n in args.nps:  # and in a rotating order: no row always follows the same one
                for label, backend, env in rows[k % len(rows):] + rows[:k % len(rows)]:
                    r = launch(backend, n, t, args, env)
                    print(f"# {label} -np {n}, {r['threads']} threads: "
                          f"{r['samples_per_s']:.1f} samples/s ({r['step_s'] * 1000:.0f} ms/step"
                          f", backward {r['backward_ms']:.0f} ms, opt.step {r['opt_step_ms']:.0f}"
                          f" ms, CPU/step main {r['cpu_main_ms']:.0f} engine "
                          f"{r['cpu_engine_ms']:.0f} other {r['cpu_other_ms']:.0f} ms, "
                          f"{r['nivcsw_per_step']:.0f} involuntary switches"
                          + (f", {r['rounds_per_step']:.1f} rounds/step)"
                             if r.get("rounds_per_step") is not None else ")"),
                          flush=True)
                    results.setdefault((label, n, t), []).append(r)
    print_table(results, [r[0] for r in rows], args)


def print_table(results: dict, labels: list, args) -> None:
    """The markdown table: a row per (threads, np), samples/s median (min-max) per backend."""
    params = results[labels[0], args.nps[0], args.threads[0]][0]["params"]
    print(f"\nResNet-18-style CNN, {params / 1e6:.1f} M parameters, batch {args.batch} per rank, "
          f"{args.steps} timed steps, median (min-max) of {args.repeats} launches\n")
    print("| threads | np | " + " | ".join(f"{b} samples/s | eff. | rounds/step | opt.step ms"
                                          " | compute CPU ms/step" for b in labels) + " |")
    print("|---|---|" + "---|---|---|---|---|" * len(labels))
    base = min(args.nps)

    def compute(r: dict) -> float:  # CPU ms per step of the threads that run torch
        return r["cpu_main_ms"] + r["cpu_other_ms"]

    def med(rs: list, key: str) -> float:
        vals = sorted(r[key] for r in rs if r.get(key) is not None)
        return statistics.median(vals) if vals else float("nan")

    for t in args.threads:
        for n in args.nps:
            cells = []
            for b in labels:
                rs = results[b, n, t]
                thr = [r["samples_per_s"] for r in rs]
                eff = med(rs, "samples_per_s") / (n / base * med(results[b, base, t],
                                                                  "samples_per_s"))
                cells += [f"{statistics.median(thr):.1f} ({min(thr):.1f}–{max(thr):.1f})",
                          f"{eff:.0%}", f"{med(rs, 'rounds_per_step'):.1f}",
                          f"{med(rs, 'opt_step_ms'):.0f}",
                          f"{statistics.median(compute(r) for r in rs):.0f}"]
            got = results[labels[0], n, t][0]["threads"]
            label = str(t) if t else f"torch default ({got})"
            print(f"| {label} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
