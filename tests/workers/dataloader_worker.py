"""torch DataLoader worker processes forked after ``init()`` (every ImageNet-style script:
Horovod's examples use ``num_workers=4``), with a DistributedSampler: the children inherit
the engine's shared memory, sockets and bucket mappings, run Python for a while and exit,
every epoch. Training through them must give bitwise the weights of ``num_workers=0``, on
every rank; the job's shared-memory segments must stay usable afterwards. Logs
``OK rank <r>``.

    mpirun -np 2 python dataloader_worker.py
"""

from __future__ import annotations

import torch
from workerlib import run, say, set_rank

import ringreduce.torch as hvd


def train(workers: int) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(384, 8)
    y = (x.sum(1, keepdim=True) > 0).float()
    data = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.distributed.DistributedSampler(
        data, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler,
                                         num_workers=workers)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(3):  # new worker processes every epoch
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb).backward()
            opt.step()
        hvd.allreduce(torch.tensor([float(epoch)]), name=f"epoch.{epoch}")  # metrics still work
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    set_rank(rank)
    plain, forked = train(0), train(2)
    assert torch.equal(plain, forked), (plain - forked).abs().max()
    same = hvd.broadcast(forked, root_rank=0, name="check")
    assert torch.equal(same, forked), "ranks differ"
    hvd.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
