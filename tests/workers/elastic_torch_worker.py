"""An elastic PyTorch job for tests/test_elastic_torch.py: ``elastic_torch_worker.py MODE``.

MODE ``kill``: the worker on fake host ``b`` dies (``os._exit(3)``) in generation 0 between
the forward and the backward pass of step ``KILL_STEP`` (the others are then mid-backward).
MODE ``grow``: at step ``GROW_STEP`` rank 0 adds ``c:1`` to the discovery file
(``$ELASTIC_DISCOVERY``); every rank then commits until the driver's host update
interrupts it, so the new worker joins at a commit.

Each worker appends JSON events to ``$RR_TEST_LOG_DIR/<worker id>.log`` (ranks change
between generations, worker ids do not): ``start`` (each attempt of the training function,
after ``sync()``), ``step``, ``commit``, ``done``. Every step checks the averaged gradients
against an allreduce of gradients computed separately, and logs whether they lie in the
DistributedOptimizer's gradient buckets. Different seeds per worker: only ``sync()`` makes
the models equal.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812

import ringreduce.torch as hvd

WID = os.environ.get("RINGREDUCE_ELASTIC_WORKER", "w?")
HOST = os.environ.get("RINGREDUCE_HOST_ID", "").rpartition(":")[2]
MODE = sys.argv[1]
N, BS, EPOCHS = 48, 4, 2
KILL_STEP, GROW_STEP = 7, 3
COMMIT_EVERY = 2


def log(ev: str, **fields: object) -> None:
    line = json.dumps({"ev": ev, "wid": WID, "host": HOST, "t": time.time(), **fields}) + "\n"
    fd = os.open(os.path.join(os.environ["RR_TEST_LOG_DIR"], f"{WID}.log"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().numpy().tobytes())
    return h.hexdigest()


def reference_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list:
    """This batch's gradients averaged over the ranks, computed apart from the optimizer."""
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    loss = F.mse_loss(torch.func.functional_call(model, params, (x,)), y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return [hvd.allreduce(g, name=f"reference.{n}") for n, g in zip(params, grads)]


def in_buckets(opt: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    buckets = opt._rr_buckets  # laid out for this generation's communicator, and used
    return (buckets is not None and opt._rr_ready() is opt._rr_comm()
            and all(buckets.holds(p.grad) for p in model.parameters()))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1000 + int(WID[1:]) if WID[1:].isdigit() else 999)
    hvd.init()
    gen = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(N, 8, generator=gen),
                                          torch.randn(N, 1, generator=gen))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   gradient_buckets=True)
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=7)
    loader = torch.utils.data.DataLoader(data, batch_size=BS, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0,
                                   step=0, grown=False)

    def commit() -> None:
        state.commit()
        log("commit", step=state.step, epoch=state.epoch,
            processed=sorted(sampler.processed_indices))

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        log("start", rank=hvd.rank(), size=hvd.size(), step=state.step, epoch=state.epoch,
            processed=sorted(sampler.processed_indices), params=digest(model),
            share=list(sampler))
        while state.epoch < EPOCHS:
            for i, (x, y) in enumerate(loader):
                reference = reference_grads(model, x, y)
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                if MODE == "kill" and HOST == "b" and state.step == KILL_STEP:
                    os._exit(3)
                loss.backward()
                opt.synchronize()
                err = max(float((p.grad - r).abs().max())
                          for p, r in zip(model.parameters(), reference))
                bucketed = in_buckets(opt, model)
                with opt.skip_synchronize():
                    opt.step()
                state.step += 1
                sampler.record_batch(i, BS)
                log("step", step=state.step, size=hvd.size(), err=err, in_buckets=bucketed,
                    stats=opt.bucket_stats())
                if MODE == "grow" and state.step == GROW_STEP and not state.grown:
                    state.grown = True
                    if hvd.rank() == 0:
                        with open(os.environ["ELASTIC_DISCOVERY"], "a") as f:
                            f.write("c:1\n")
                    for _ in range(100):  # the driver polls discovery every second
                        commit()
                        time.sleep(0.1)
                elif state.step % COMMIT_EVERY == 0:
                    commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            commit()

    train(state)
    log("done", rank=hvd.rank(), size=hvd.size(), step=state.step, epoch=state.epoch,
        params=digest(model), stats=opt.bucket_stats())


if __name__ == "__main__":
    main()
