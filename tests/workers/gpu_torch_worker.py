"""ringreduce.torch on a CUDA model (tests/gpu/): DistributedOptimizer, broadcast_parameters,
broadcast_optimizer_state and SyncBatchNorm, unchanged from the CPU recipe but for
``.cuda()``. Every rank trains on its slice of the batch; the weights must equal one
process training on the whole batch (computed here with plain torch), and be identical on
every rank. Also DistributedOptimizer with Compression.fp16 through the GPU executor's
casts. Logs ``OK rank <r>``.

    python gpu_torch_worker.py        # one process per GPU
"""

from __future__ import annotations

import copy

import torch
from workerlib import run, say, set_rank

import ringreduce.torch as rr


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def check_compressed_optimizer(rank: int, size: int) -> None:
    """DistributedOptimizer with Compression.fp16 on a float32 CUDA parameter: the gradient
    goes to the GPU executor uncast, travels as float16 (cast in its pack kernel) and is
    averaged in float32 in its unpack: SGD's step is minus the float16-rounded mean."""
    w = torch.nn.Parameter(torch.zeros(64, device="cuda"))
    opt = rr.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("cw", w)],
                                  compression=rr.Compression.fp16)

    def grad(r: int) -> torch.Tensor:  # k / 8 + r + 1 is exact in float16; 2^-12 is not
        return (torch.arange(64) % 7 / 8 + r + 1 + 2.0 ** -12).float()

    (w * grad(rank).cuda()).sum().backward()
    opt.step()
    wsum = sum(grad(r).half().float() for r in range(size))
    assert torch.equal(w.detach().cpu(), -(wsum * torch.tensor(1 / size))), w


def main() -> None:
    rr.init()
    rank, size = rr.rank(), rr.size()
    set_rank(rank)
    torch.cuda.set_device(rr.local_rank() % torch.cuda.device_count())
    torch.manual_seed(1234 + rank)  # different initial weights: the broadcast must fix them
    model = rr.SyncBatchNorm.convert_sync_batchnorm(net()).cuda()
    opt = rr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    rr.broadcast_parameters(model.state_dict(), root_rank=0)
    rr.broadcast_optimizer_state(opt, root_rank=0)
    ref = net().cuda()
    ref.load_state_dict({k.replace("module.", ""): v for k, v in model.state_dict().items()})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = torch.randn(8 * size, 4, generator=gen, dtype=torch.float64).cuda()
        y = torch.randn(8 * size, 1, generator=gen, dtype=torch.float64).cuda()
        mine = slice(rank * 8, (rank + 1) * 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.is_cuda and torch.allclose(p, q, rtol=1e-9, atol=1e-12), name
        same = rr.broadcast(p.detach(), root_rank=0, name=f"check.{name}")
        assert torch.equal(same, p.detach()), f"rank {rank}: {name} differs from rank 0"
    copy.deepcopy(model.state_dict())  # the state is ordinary CUDA tensors
    check_compressed_optimizer(rank, size)
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
