"""Rank-0 checkpoints of ringreduce.torch: atomic writes, errors on every rank, exact resume."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")

from procs import run_single  # noqa: E402

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.checkpoint import CheckpointError, atomic_write  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

torch.set_num_threads(1)


def run(n, fn):
    def body(c):
        with rrt.use_communicator(c):
            return fn(c.rank())

    return run_threaded(n, body, timeout=60, return_exceptions=True)


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    return model


def batches(steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g))
            for _ in range(steps)]


def train(model, opt, data, rank, n):
    for x, y in data:
        per = len(x) // n
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]),
                                     y[rank * per:(rank + 1) * per]).backward()
        opt.step()


def test_save_on_rank0_only_and_load_everywhere(tmp_path):
    path = str(tmp_path / "sub" / "ckpt.pt")
    models = [make(r) for r in range(2)] + [make(10 + r) for r in range(2)]  # torch's RNG is
    # process-wide: seeding it in threads would race

    def fn(rank):
        model = models[rank]  # different on every rank
        opt = rrt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        wrote = rrt.save_checkpoint(path, model=model, optimizer=opt, epoch=4, note="x")
        rrt.barrier()
        fresh = models[2 + rank]
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        ckpt = rrt.load_checkpoint(path, model=fresh, optimizer=fresh_opt)
        return wrote, ckpt["epoch"], ckpt["note"], fresh.state_dict(), fresh_opt.param_groups

    (w0, e0, n0, s0, g0), (w1, e1, n1, s1, g1) = run(2, fn)
    assert (w0, w1) == (True, False)
    assert e0 == e1 == 4 and n0 == n1 == "x"
    for k, v in make(0).state_dict().items():
        assert torch.equal(s0[k], v) and torch.equal(s1[k], v)
    assert g0[0]["lr"] == g1[0]["lr"] == 0.1
    assert sorted(os.listdir(tmp_path / "sub")) == ["ckpt.pt"]


def test_missing_and_corrupt_files_fail_on_every_rank(tmp_path):
    missing = str(tmp_path / "nope.pt")
    corrupt = tmp_path / "bad.pt"
    corrupt.write_bytes(b"not a checkpoint")
    plain = tmp_path / "list.pt"
    torch.save([1, 2], plain)

    def fn(rank):
        out = [rrt.load_checkpoint(missing, missing_ok=True)]
        for path in (missing, str(corrupt), str(plain)):
            try:
                rrt.load_checkpoint(path, model=torch.nn.Linear(1, 1))
            except CheckpointError as err:
                out.append(str(err))
        try:
            rrt.save_checkpoint(str(tmp_path / "ok.pt"), epoch=1)
            rrt.barrier()
            rrt.load_checkpoint(str(tmp_path / "ok.pt"), model=torch.nn.Linear(1, 1))
        except CheckpointError as err:
            out.append(str(err))
        return out

    for rank, out in enumerate(run(2, fn)):
        assert out[0] is None
        assert len(out) == 5, out
        assert "rank 0 reports: no checkpoint at" in out[1]
        assert f"on rank {rank}" in out[1]
        assert "cannot read checkpoint" in out[2]
        assert "not a checkpoint written by save_checkpoint" in out[3]
        assert "has no entries ['model']" in out[4]


def test_resume_gives_the_same_parameters(tmp_path):
    """Train 6 steps straight == train 3, checkpoint, resume in fresh objects, train 3."""
    path = str(tmp_path / "ckpt.pt")
    data = batches(6)
    models = [(make(), make(seed=99)) for _ in range(2)]

    def fn(rank):
        model, model2 = models[rank]
        opt = rrt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
        rrt.broadcast_parameters(model.state_dict(), root_rank=0)
        train(model, opt, data[:3], rank, 2)
        sched.step()
        rrt.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3)
        rrt.barrier()
        train(model, opt, data[3:], rank, 2)
        straight = copy.deepcopy(model.state_dict())

        opt2 = rrt.DistributedOptimizer(torch.optim.AdamW(model2.parameters(), lr=0.05),
                                        named_parameters=model2.named_parameters())
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.9)
        ckpt = rrt.load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
        assert ckpt["step"] == 3
        train(model2, opt2, data[3:], rank, 2)
        return straight, model2.state_dict()

    for out in run(2, fn):
        assert not isinstance(out, BaseException), out
        straight, resumed = out
        for k in straight:
            assert torch.equal(straight[k], resumed[k]), k


@pytest.mark.parametrize("kill_at", ["write", "fsync"])
def test_writer_killed_mid_save_leaves_the_old_checkpoint(tmp_path, kill_at):
    path = tmp_path / "ckpt.pt"
    job = run_single("torch_checkpoint_worker.py", [path, "--kill-at", kill_at], timeout=60)
    assert job.procs[0].returncode == -9, job.describe()
    assert job.event(0, "dying") is not None and job.event(0, "survived") is None, job.describe()
    leftovers = [p for p in os.listdir(tmp_path) if p != "ckpt.pt"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), leftovers
    rrt.init()
    try:
        model = torch.nn.Linear(4, 3)
        ckpt = rrt.load_checkpoint(str(path), model=model)
        assert ckpt["epoch"] == 1
        assert torch.equal(model.weight, torch.ones(3, 4))
        # The next save cleans up after the dead writer.
        rrt.save_checkpoint(str(path), model=model, epoch=5)
        assert os.listdir(tmp_path) == ["ckpt.pt"]
        assert rrt.load_checkpoint(str(path))["epoch"] == 5
    finally:
        rrt.shutdown()


def test_atomic_write_failure_keeps_old_file(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(str(path), lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"partial")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        atomic_write(str(path), broken)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    (tmp_path / "dir").mkdir()
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        atomic_write(str(tmp_path / "dir"), lambda f: f.write(b"x"))
    assert issubclass(CheckpointError, rr.RingReduceError)
