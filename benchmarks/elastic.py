"""Elastic training: what a commit costs and how long a job takes to recover from a dead
worker, ringreduce (``ringrun --min-np``) next to torchrun's elastic restart.

    python benchmarks/elastic.py --mb 100 --repeats 3

Each job trains 3 workers on 3 hosts (fake hosts: names that a local ssh stand-in runs
here, so each counts as a host of its own and ranks talk over TCP) with a state of
``--mb`` MB (float32 weights) and a 1 MB gradient allreduce per step, committing every
``--every`` steps; worker 2 exits (code 3) right after step ``--die-at``. Reported per job:

* commit: mean time of ``state.commit()`` (ringreduce: an in-memory copy plus one
  question to ringrun; torchrun: ``torch.save`` of the state to a file, the usual way);
* recovery: from the death to the end of the first step the job completes afterwards,
  measured on rank 0's clock (all processes share this machine's clock);
* after: the job's size after recovery (ringreduce goes on with the 2 survivors;
  torchrun stops every worker and starts 3 new ones, which load the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------- workers
def _log(path: str, **event: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def worker_ringreduce(a: argparse.Namespace) -> None:
    import numpy as np

    import ringreduce as rr

    rr.init()
    state = rr.elastic.ObjectState(step=0, weights=np.zeros(a.mb * 2**18, np.float32))
    me = os.environ["RINGREDUCE_ELASTIC_WORKER"]
    grad = np.ones(2**18, np.float32)
    commits: list[float] = []

    @rr.elastic.run
    def train(state: rr.elastic.ObjectState) -> None:
        resumed = state.step > 0 and rr.size() < 3
        while state.step < a.steps:
            rr.allreduce_(grad, op=rr.Average, name="grad")
            state.weights[:4] += grad[:4]
            state.step += 1
            if resumed and rr.rank() == 0:
                _log(a.log, ev="resumed", t=time.time(), size=rr.size())
                resumed = False
            if me == "w2" and state.step == a.die_at:
                _log(a.log, ev="death", t=time.time())
                os._exit(3)
            if state.step % a.every == 0:
                t0 = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - t0)

    train(state)
    if rr.rank() == 0:
        _log(a.log, ev="commit", s=statistics.mean(commits))


def worker_torch(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    # A store prefix per restart: without it the restarted workers found the dead
    # group's Gloo addresses and hung in connectFullMesh (torch 2.13; pytorch#167288).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, use_libuv=True)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"bench-restart-{restart}", base),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    rank, ckpt = dist.get_rank(), Path(a.log).with_suffix(".pt")
    state = {"step": 0, "weights": torch.zeros(a.mb * 2**18)}
    restarted = ckpt.exists()
    if restarted:
        state = torch.load(ckpt)
    grad, commits = torch.ones(2**18), []
    first = restart == "0"
    while state["step"] < a.steps:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
        state["weights"][:4] += grad[:4]
        state["step"] += 1
        if restarted and rank == 0:
            _log(a.log, ev="resumed", t=time.time(), size=dist.get_world_size())
            restarted = False
        if first and rank == 2 and state["step"] == a.die_at:
            _log(a.log, ev="death", t=time.time())
            os._exit(3)
        if state["step"] % a.every == 0 and rank == 0:
            t0 = time.perf_counter()
            torch.save(state, ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
            commits.append(time.perf_counter() - t0)
        if state["step"] % a.every == 0:
            dist.barrier()  # every rank restarts from the same commit
    if rank == 0:
        _log(a.log, ev="commit", s=statistics.mean(commits))
    dist.destroy_process_group()


# -------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(system: str, a: argparse.Namespace, log: Path) -> list[str]:
    me = [sys.executable, str(HERE), "--worker", system, "--events", str(log), "--mb", str(a.mb),
          "--steps", str(a.steps), "--every", str(a.every), "--die-at", str(a.die_at)]
    if system == "ringreduce":
        return [sys.executable, "-m", "ringreduce", "-np", "3", "--min-np", "2",
                "-H", "a:1,b:1,c:1", "--ssh-command", "env RR_FAKE_HOST={host} sh -c",
                "--master-addr", "127.0.0.1", *me]
    torchrun = shutil.which("torchrun") or "torchrun"
    return [torchrun, "--nnodes", "1", "--nproc-per-node", "3", "--max-restarts", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "--monitor-interval", "0.1", str(HERE), *me[2:]]


def run_one(system: str, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rr-elastic-bench-") as tmp:
        log = Path(tmp) / "events.jsonl"
        done = subprocess.run(_job(system, a, log), capture_output=True, text=True,
                              timeout=600, cwd=tmp)
        events = [json.loads(line) for line in log.read_text().splitlines()] \
            if log.exists() else []
    got = {e["ev"]: e for e in events}
    if done.returncode != 0 or not {"death", "resumed", "commit"} <= set(got):
        raise RuntimeError(f"{system} job failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return {"commit_ms": got["commit"]["s"] * 1e3,
            "recovery_s": got["resumed"]["t"] - got["death"]["t"],
            "after": got["resumed"]["size"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=100, help="state size in MB")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="commit every N steps")
    p.add_argument("--die-at", type=int, default=25)
    p.add_argument("--repeats", type=int, default=3, help="jobs per system, interleaved")
    p.add_argument("--peers", default="torchrun", help="'torchrun' or 'none'")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--events", dest="log", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        (worker_ringreduce if a.worker == "ringreduce" else worker_torch)(a)
        return
    systems = ["ringreduce"] + (["torchrun"] if a.peers == "torchrun" else [])
    print(f"# 3 workers on 3 fake hosts, state {a.mb} MB, commit every {a.every} steps, "
          f"worker 2 dies after step {a.die_at}; {a.repeats} interleaved job(s) each")
    print(f"{'system':>12} {'job':>4} {'commit (ms)':>12} {'recovery (s)':>13} {'size after':>11}")
    for i in range(a.repeats):
        for system in systems:
            r = run_one(system, a)
            print(f"{system:>12} {i:>4} {r['commit_ms']:>12.2f} {r['recovery_s']:>13.2f} "
                  f"{r['after']:>11}", flush=True)


if __name__ == "__main__":
    main()
