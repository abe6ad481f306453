"""A whole GPU training step of ResNet-50 on synthetic images, three ways in one run and
one table: no communication, ``ringreduce.torch.DistributedOptimizer`` and torch's
``DistributedDataParallel`` (NCCL).

One process per GPU, launched by ringreduce's launcher or mpirun::

    ringrun -np 2 python benchmarks/gpu_step.py
    ringrun -np 2 python benchmarks/gpu_step.py --model small --batch 64 --steps 20

A step is ``zero_grad``, forward, cross-entropy, backward and SGD's ``step`` (momentum 0.9)
on a fixed batch of ``--batch`` images per rank (224 x 224 for ResNet-50, which needs
torchvision; ``--model small``: a few convolutions on 32 x 32 images). Every
implementation owns its own copy of the model, made from one seed. Rounds are interleaved
(the order rotates each round); each timed step is preceded by a device sync and a host
barrier and ends with a device sync; a round's time is the slowest rank's, and the table
gives the median over ``--steps`` rounds after ``--warmup``. "added" is a step's time minus
``no-comm``'s: what the gradient averaging costs (overlap with backward included).
"ranks agree" checks that every rank holds rank 0's weights after the timed steps.
A second table splits ringreduce's step on rank 0 (medians per step, host time): its
gradient hooks (the Python and C++ intake of every gradient during backward),
``synchronize()`` (the wait for the averaged gradients, the GPU's backward included),
the optimizer's step, and the engine's rounds, responses and tensors, and how often it held
GPU work back while the device was behind (``RINGREDUCE_GPU_QUEUE_DEPTH``).

At np=1 the allreduces move nothing, so the table shows each library's own cost per step.
Where ranks share a GPU (gpu_common.this_rank_gpu) NCCL goes over loopback sockets: the
run checks that everything works, it does not measure a GPU's speed.
Without a CUDA device (or NCCL) it exits at once with status 2 and says what is missing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from gpu_common import init_torch_nccl, require_gpu, this_rank_gpu

import ringreduce as rr

NOCOMM, RR, DDP = "no-comm", "ringreduce", "torch-ddp"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["resnet50", "small"], default="resnet50")
    p.add_argument("--batch", type=int, default=32, help="images per rank (default 32)")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    return p.parse_args()


def make_model(kind: str) -> tuple[Any, tuple[int, int, int]]:
    """A fresh model (seeded by the caller) and its input's (channels, height, width)."""
    import torch

    if kind == "resnet50":
        import torchvision

        return torchvision.models.resnet50(), (3, 224, 224)
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000)), (3, 32, 32)


def build(impl: str, kind: str, device: int) -> tuple[Any, Any]:
    """``impl``'s model on ``device`` and its optimizer, from the same seed on every rank."""
    import torch

    import ringreduce.torch as hvd

    torch.manual_seed(0)
    model = make_model(kind)[0].cuda(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if impl == RR:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif impl == DDP:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
    return model, opt


def stepper(model: Any, opt: Any, x: Any, y: Any) -> Callable[[], None]:
    import torch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


class Breakdown:
    """Host time of ringreduce's parts of a step: its hooks, synchronize(), step()."""

    PARTS = ("hooks", "synchronize", "step", "rounds", "responses", "tensors", "device_holds")

    def __init__(self, opt: Any) -> None:
        self.opt, self.now = opt, {k: 0.0 for k in self.PARTS}
        self.steps: list = []
        submit = opt._rr_submit  # the per-gradient intake (ringreduce/torch/optimizer.py)

        def timed_submit(slot: Any) -> None:
            t = time.perf_counter()
            submit(slot)
            self.now["hooks"] += time.perf_counter() - t

        opt._rr_submit = timed_submit

    def stepper(self, model: Any, x: Any, y: Any) -> Callable[[], None]:
        import torch

        def step() -> None:
            before = rr._comm()._engine.stats()
            self.opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            t0 = time.perf_counter()
            self.opt.synchronize()
            t1 = time.perf_counter()
            with self.opt.skip_synchronize():
                self.opt.step()
            self.now["synchronize"], self.now["step"] = t1 - t0, time.perf_counter() - t1
            after = rr._comm()._engine.stats()
            for k in ("rounds", "responses", "tensors", "device_holds"):
                self.now[k] = after[k] - before[k]
            self.steps.append(self.now)
            self.now = {k: 0.0 for k in self.PARTS}

        return step

    def lines(self, warmup: int) -> list:
        mid = {k: statistics.median(s[k] for s in self.steps[warmup:]) for k in self.PARTS}
        return [f"# ringreduce's step on rank 0 (medians): hooks {mid['hooks'] * 1e3:.2f} ms, "
                f"synchronize() {mid['synchronize'] * 1e3:.2f} ms, step() "
                f"{mid['step'] * 1e3:.2f} ms; engine: {mid['rounds']:.0f} rounds, "
                f"{mid['responses']:.0f} responses, {mid['tensors']:.0f} tensors, "
                f"{mid['device_holds']:.0f} holds for the GPU"]


def timed_rounds(steps: dict, args: argparse.Namespace) -> dict:
    """Each implementation's step time per timed round, the slowest rank's (s)."""
    import torch

    names = list(steps)
    mine: dict = {name: [] for name in names}
    for r in range(args.warmup + args.steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            rr.barrier()
            t = time.perf_counter()
            steps[name]()
            torch.cuda.synchronize()
            if r >= args.warmup:
                mine[name].append(time.perf_counter() - t)
    every = rr.allgather_object(mine, name="gpu_step.times")
    return {name: [max(rank[name][i] for rank in every) for i in range(args.steps)]
            for name in names}


def ranks_agree(model: Any) -> bool:
    import torch

    import ringreduce.torch as hvd

    ok = all(torch.equal(hvd.broadcast(p.detach(), root_rank=0, name=f"agree.{i}"), p.detach())
             for i, p in enumerate(model.parameters()))
    return all(rr.allgather_object(ok, name="agree"))


def main() -> None:
    args = parse_args()
    require_gpu("gpu_step")
    import torch

    rr.init()
    device, gpus = this_rank_gpu()
    torch.cuda.set_device(device)
    impls = [NOCOMM, RR]
    try:
        init_torch_nccl(device)
        impls.append(DDP)
    except Exception as e:  # noqa: BLE001 - a peer that cannot start is left out, said why
        print(f"# torch DDP left out on rank {rr.rank()}: {e}")
    shape = make_model(args.model)[1]
    gen = torch.Generator().manual_seed(rr.rank())
    x = torch.randn(args.batch, *shape, generator=gen).cuda()
    y = torch.randint(0, 1000, (args.batch,), generator=gen).cuda()
    models = {name: build(name, args.model, device) for name in impls}
    steps = {name: stepper(*models[name], x, y) for name in impls}
    parts = Breakdown(models[RR][1])
    steps[RR] = parts.stepper(models[RR][0], x, y)
    times = timed_rounds(steps, args)
    agree = {name: ranks_agree(models[name][0]) for name in impls if name != NOCOMM}
    if rr.rank() == 0:
        report(args, times, agree, gpus)
        print("\n".join(parts.lines(args.warmup)))
    rr.shutdown()


def report(args: argparse.Namespace, times: dict, agree: dict, gpus: int) -> None:
    n = rr.size()
    shared = " (ranks share a GPU: NCCL over loopback sockets)" if n > gpus else ""
    print(f"# gpu_step: {args.model}, {args.batch} images per rank, {n} ranks on {gpus} "
          f"GPU(s){shared}; median of {args.steps} rounds")
    base = statistics.median(times[NOCOMM])
    print(f"{'implementation':>16} | {'step (ms)':>10} | {'added (ms)':>10} | "
          f"{'images/s':>10} | ranks agree")
    for name, ts in times.items():
        med = statistics.median(ts)
        added = "" if name == NOCOMM else f"{(med - base) * 1e3:.2f}"
        check = "" if name == NOCOMM else ("ok" if agree[name] else "DIFFER")
        print(f"{name:>16} | {med * 1e3:>10.2f} | {added:>10} | {n * args.batch / med:>10.0f} | "
              f"{check}")


if __name__ == "__main__":
    main()
