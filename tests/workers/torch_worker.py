"""ringreduce.torch in real processes: optimizer, broadcasts, SyncBatchNorm, checkpoints.

    mpirun -np N python torch_worker.py CHECKPOINT_DIR

Each check raises on failure; at the end every rank logs ``OK rank <r>``.
"""

from __future__ import annotations

import os
import sys

import torch
from workerlib import event, run, say, set_rank

import ringreduce.torch as rr


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])


def check_same_everywhere(t: torch.Tensor, label: str) -> None:
    everyone = rr.allgather(t[None], name=f"check.{label}")
    for r in range(rr.size()):
        if not torch.equal(everyone[r], t):
            raise AssertionError(f"rank {rr.rank()}: {label} differs from rank {r}")


def train_steps() -> torch.nn.Module:
    torch.manual_seed(rr.rank())  # different everywhere until the broadcast
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), rr.SyncBatchNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    opt = rr.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  compression=rr.Compression.bf16)
    rr.broadcast_parameters(model.state_dict(), root_rank=0)
    rr.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rr.rank())
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    check_same_everywhere(flat(model), "parameters after training")
    event("trained", params=int(flat(model).numel()))
    return model


def compiled() -> None:
    """A ``torch.compile``d model (AOTAutograd, as inductor uses, without its C++ build)
    trains as the same model eagerly: the gradient hooks fire under the compiled backward."""
    def make() -> torch.nn.Module:
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 2)).double()

    finals, hooked = [], []
    for compile_it in (False, True):
        model = make()
        opt = rr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
        forward = torch.compile(model, backend="aot_eager") if compile_it else model
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rr.rank())  # each rank its own data
            x, y = torch.randn(8, 6, generator=g).double(), torch.randn(8, 2, generator=g).double()
            opt.zero_grad()
            torch.nn.functional.mse_loss(forward(x), y).backward()
            # the hooks started every gradient's allreduce during backward (without them
            # step() would still average, unoverlapped: the parameters alone cannot tell)
            hooked.append(len(opt._rr_inflight))
            opt.step()
        finals.append(flat(model))
    check_same_everywhere(finals[1], "compiled model's parameters")
    diff = float((finals[0] - finals[1]).abs().max())
    if diff > 1e-12:
        raise AssertionError(f"rank {rr.rank()}: the compiled model ended {diff} from eager")
    params = len(list(model.parameters()))
    if hooked != [params] * 6:
        raise AssertionError(f"rank {rr.rank()}: allreduces started by the hooks per step: "
                             f"{hooked}, not {params} (eager then compiled)")
    event("compiled", diff=diff, hooked=hooked)


def checkpoints(model: torch.nn.Module, directory: str) -> None:
    path = os.path.join(directory, "ckpt.pt")
    wrote = rr.save_checkpoint(path, model=model, epoch=7)
    if wrote != (rr.rank() == 0):
        raise AssertionError(f"rank {rr.rank()}: save_checkpoint returned {wrote}")
    rr.barrier()
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 16), rr.SyncBatchNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    ckpt = rr.load_checkpoint(path, model=fresh)
    if ckpt["epoch"] != 7 or not torch.equal(flat(fresh), flat(model)):
        raise AssertionError(f"rank {rr.rank()}: loaded checkpoint differs")
    try:
        rr.load_checkpoint(os.path.join(directory, "missing.pt"), model=fresh)
    except rr.CheckpointError as err:
        event("missing-error", msg=str(err))
    else:
        raise AssertionError("loading a missing checkpoint did not raise")


def main() -> None:
    rr.init()
    set_rank(rr.rank())
    torch.set_num_threads(1)
    model = train_steps()
    checkpoints(model, sys.argv[1])
    compiled()
    rr.barrier()
    say(f"OK rank {rr.rank()}")
    rr.shutdown()


if __name__ == "__main__":
    run(main)
