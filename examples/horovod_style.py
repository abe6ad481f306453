"""A Horovod training script that runs on ringreduce by changing only the import.

    mpirun -np 2 python examples/horovod_style.py

Everything below is written exactly as for ``horovod.torch``: init, pinning threads
by local rank, DistributedOptimizer with fp16 compression and gradient accumulation,
broadcasting the initial state, averaging a metric with ``hvd.allreduce``, and
logging on rank 0 only. The model fits a noisy linear map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ringreduce.torch as hvd  # was: import horovod.torch as hvd

ACCUMULATE = 2  # backward passes per optimizer step

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(1234 + hvd.rank())  # per-rank data; the model is broadcast below

true_w = torch.arange(1.0, 9.0).view(8, 1)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.5)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16,
                                     backward_passes_per_step=ACCUMULATE)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
config = hvd.broadcast_object({"steps": 150} if hvd.rank() == 0 else None, root_rank=0)

first = None
for step in range(config["steps"]):
    optimizer.zero_grad()
    for _ in range(ACCUMULATE):
        x = torch.randn(32, 8)
        y = x @ true_w + 0.01 * torch.randn(32, 1)
        loss = F.mse_loss(model(x), y) / ACCUMULATE
        loss.backward()
    optimizer.step()
    avg = hvd.allreduce(loss.detach() * ACCUMULATE, name="avg_loss")  # Average by default
    first = float(avg) if first is None else first
    if hvd.rank() == 0 and step % 50 == 0:
        print(f"step {step:4d}  loss {float(avg):.5f}", flush=True)

weights = hvd.allgather(model.weight.detach(), name="final_weights")
same = all(torch.equal(weights[0], w) for w in weights)
if hvd.rank() == 0:
    print(f"final loss {float(avg):.5f} (from {first:.3f}); weights equal on all "
          f"{hvd.size()} ranks: {same}", flush=True)
if not (same and float(avg) < 0.01 * first):
    raise SystemExit(f"rank {hvd.rank()}: training did not converge or ranks diverged")
