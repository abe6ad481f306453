"""ringreduce.torch on a CUDA model (tests/gpu/): DistributedOptimizer, broadcast_parameters,
broadcast_optimizer_state and SyncBatchNorm, unchanged from the CPU recipe but for
``.cuda()``. Every rank trains on its slice of the batch; the weights must equal one
process training on the whole batch (computed here with plain torch), and be identical on
every rank. Also DistributedOptimizer with Compression.fp16 through the GPU executor's
casts, and Horovod's AMP recipe (autocast, GradScaler, synchronize / unscale_ /
skip_synchronize) with a step that overflows on one rank. Logs ``OK rank <r>``.

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
    assert [type(s.handle).__name__ for s in opt._rr_inflight] == ["ArrayHandle"]
    opt.step()
    wsum = sum(grad(r).half().float() for r in range(size))
    assert torch.equal(w.detach().cpu(), -(wsum * torch.tensor(1 / size))), w


def check_stream_ordered(rank: int, size: int) -> None:
    """DistributedOptimizer waits for CUDA gradients as DDP does, ordering the current
    stream after the allreduce instead of blocking the host: 20 steps with no host sync
    (the host runs ahead, and a step's allreduce may still hold the name when the next
    backward submits it again), one synchronize() on a side stream (not the gradient's:
    the host waits then), and the weights equal one process's on the whole batch."""
    w0 = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    p = torch.nn.Parameter(w0.clone().cuda())
    q = w0.clone().cuda().requires_grad_()
    opt = rr.DistributedOptimizer(torch.optim.SGD([p], lr=0.01), named_parameters=[("so", p)])
    ref = torch.optim.SGD([q], lr=0.01)
    gen = torch.Generator().manual_seed(11)
    for i in range(20):
        x = torch.randn(4 * size, 64, generator=gen, dtype=torch.float64).cuda()
        opt.zero_grad()
        (p @ x[rank * 4:(rank + 1) * 4].T).pow(2).mean().backward()
        if i == 7:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                opt.synchronize()
            assert opt._rr_order[0].prior is None  # waited on the host
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref.zero_grad()
        (q @ x.T).pow(2).mean().backward()
        ref.step()
    assert opt._rr_order[0].prior is not None  # the last step's wait was stream-ordered
    assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), (p - q).abs().max()


def check_amp_grad_scaler(rank: int, size: int) -> None:
    """autocast(float16) and GradScaler on CUDA, Horovod's way: synchronize(), unscale_(),
    step() under skip_synchronize(). The weights follow one process on the whole batch; at
    step 1 the last rank's loss is inf, so the averaged gradient is not finite on every rank:
    every rank skips that step and halves its scale."""
    torch.manual_seed(5)
    model = torch.nn.Linear(16, 4).cuda()
    ref = copy.deepcopy(model)
    opt = rr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=[(f"amp.{n}", p)
                                                    for n, p in model.named_parameters()])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    gen = torch.Generator().manual_seed(11)
    for step in range(3):
        x = torch.randn(4 * size, 16, generator=gen).cuda()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x[rank * 4:(rank + 1) * 4]).float().pow(2).mean()
        if step == 1 and rank == size - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        if step != 1:
            ref_opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                ref(x).float().pow(2).mean().backward()
            ref_opt.step()
    assert scaler.get_scale() == 2.0 ** 9, scaler.get_scale()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-3, atol=1e-5), (p, q)
        assert torch.equal(rr.broadcast(p.detach(), root_rank=0, name="amp.check"), p.detach())


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
        kinds = {type(s.handle).__name__ for s in opt._rr_inflight}
        assert kinds == {"ArrayHandle"}, kinds  # the described CUDA path, allreduce_cuda_
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
    check_stream_ordered(rank, size)
    check_amp_grad_scaler(rank, size)
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
