"""Elastic training with PyTorch (ringreduce.torch.elastic): TorchState, ElasticSampler and
DistributedOptimizer across resets.

In process: the sampler's re-partitioning, TorchState's save/restore, and a
DistributedOptimizer of an elastic job before and after its per-generation setup (threads
as ranks). Launched (``ringrun --min-np``, fake hosts, tests/workers/elastic_torch_worker.py):
a worker killed mid-step, and a host added during training.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from elastic_jobs import elastic_args, generations, run_elastic  # noqa: E402
from procs import PYTHON, WORKERS  # noqa: E402

import ringreduce.torch as hvd  # noqa: E402
from ringreduce.elastic import sampling  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

torch.set_num_threads(1)
WORKER = str(WORKERS / "elastic_torch_worker.py")


# ------------------------------------------------------------------ in process
class FakeWorld:
    """Stands for ``(size(), rank())`` as the sampler reads it."""

    def __init__(self) -> None:
        self.size, self.rank = 1, 0

    def __call__(self) -> tuple[int, int]:
        return self.size, self.rank


def samplers(monkeypatch, world: FakeWorld, dataset, size: int, state=None) -> list:
    world.size, out = size, []
    for r in range(size):
        world.rank = r
        s = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
        if state is not None:
            s.load_state_dict(state)
        out.append(s)
    return out


def test_sampler_repartitions_the_remaining_samples(monkeypatch):
    world = FakeWorld()
    monkeypatch.setattr(sampling, "_world", world)
    data = list(range(23))
    three = samplers(monkeypatch, world, data, 3)
    shares = [list(s) for s in three]
    assert [len(s) for s in three] == [8, 8, 8]
    assert sorted(sum(shares, [])) == sorted(data + [shares[0][0]])  # padded by one
    assert set(shares[0]) & set(shares[1]) == set()
    for s in three:  # two batches of 2 per rank: each rank records every rank's
        s.record_batch(0, 2)
        s.record_batch(1, 2)
    done = {i for share in shares for i in share[:4]}
    assert all(s.processed_indices == done for s in three) and len(done) == 12

    two = samplers(monkeypatch, world, data, 2, state=three[0].state_dict())
    rest = [list(s) for s in two]
    assert [len(s) for s in rest] == [6, 6]
    assert set(rest[0]) | set(rest[1]) == set(data) - done  # 11 left, one padding
    assert not (set(rest[0]) | set(rest[1])) & done
    assert rest[0][0] == two[0].get_indices(0, 2)[0]

    epoch1 = samplers(monkeypatch, world, data, 2, state={"epoch": 1, "processed_indices": set()})
    assert list(epoch1[0]) != list(samplers(monkeypatch, world, data, 2)[0])  # new order
    world.rank = 0  # (the fake world is shared: rank 0's reset)
    two[0].set_epoch(1)
    assert list(two[0]) == list(epoch1[0]) and not two[0].processed_indices

    # sync(): every rank gets the union of the ranks' records
    a, b = samplers(monkeypatch, world, data, 2, state=three[0].state_dict())
    a.record_indices([rest[0][0]])
    b.record_indices([rest[1][0]])
    gathered = [set(a.processed_indices), set(b.processed_indices)]
    sampling.merge_processed(b, lambda obj: gathered, lambda obj: obj)
    assert b.processed_indices == done | {rest[0][0], rest[1][0]}
    assert len(b) == 5 and not set(b) & b.processed_indices


def test_torch_state_save_restore(monkeypatch):
    monkeypatch.setattr(sampling, "_world", FakeWorld())
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0,
                                   history=[])
    assert state.model is model and state.optimizer is opt and state.sampler is sampler

    def train_step():
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    train_step()
    state.epoch, state.history = 1, [1.5]
    sampler.record_batch(0, 3)
    state.save()  # what commit() saves
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()

    train_step()
    state.epoch = 2
    state.history.append(2.5)
    sampler.record_batch(1, 3)
    assert not torch.equal(model.weight, saved["weight"])
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert (state.epoch, state.history) == (1, [1.5])
    assert sampler.processed_indices == {0, 1, 2} and list(sampler) == list(range(3, 10))

    other = torch.nn.Linear(4, 3)  # a model put in the state later is the one committed
    state.model = other
    state.save()
    committed = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1)
    state.restore()
    assert torch.equal(other.weight, committed) and state.model is other


def test_optimizer_setup_is_deferred_in_an_elastic_job(monkeypatch):
    """Before sync() an elastic job's DistributedOptimizer averages without buckets and
    without any collective at construction; sync() lays the buckets out on every rank."""
    monkeypatch.setenv("RINGREDUCE_ELASTIC_DRIVER", "127.0.0.1:1")

    def body(c):
        with hvd.use_communicator(c):
            torch.manual_seed(c.rank())
            model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           gradient_buckets=True)
            before = opt._rr_buckets
            x = torch.full((3, 4), float(c.rank() + 1))

            def grads():
                opt.zero_grad()
                model(x).sum().backward()
                opt.synchronize()
                return [p.grad.clone() for p in model.parameters()]

            unbucketed = grads()
            state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
            state.sync()
            with torch.no_grad():  # a failure before the first commit: back to rank 0's
                model[0].weight.add_(c.rank() + 1)
            state.restore()
            synced = [p.detach().clone() for p in model.parameters()]
            bucketed = grads()
            held = all(opt._rr_buckets.holds(p.grad) for p in model.parameters())
            again = opt.elastic_setup()  # already set up for this communicator
            # A reset that skips sync() (hosts only removed): on_reset() drops the buckets,
            # the first commit() lays them out again.
            first = opt._rr_buckets
            state.on_reset()
            dropped = opt._rr_buckets is None and all(p.grad is None for p in model.parameters())
            state.commit()
            relaid = opt._rr_buckets is not None and opt._rr_buckets is not first
            held = held and dropped and relaid and torch.equal(grads()[0], bucketed[0]) and all(
                opt._rr_buckets.holds(p.grad) for p in model.parameters())
            return before, unbucketed, bucketed, held, again, opt.bucket_stats(), synced

    out = run_threaded(2, body, timeout=20)
    for before, _, _, held, again, stats, _ in out:
        assert before is None and held and again is False
        assert stats["buckets"] == 1 and stats["fallbacks"] == 0
    # before the sync the models differed: the averages still agree across ranks
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert all(torch.equal(a, b) for a, b in zip(out[0][2], out[1][2]))
    assert all(torch.equal(a, b) for a, b in zip(out[0][6], out[1][6]))


def test_reset_drops_an_interrupted_step(monkeypatch):
    """A step cut short (gradients in flight, no step()) is forgotten at a reset, also by a
    DistributedOptimizer that no TorchState holds."""
    import ringreduce as rr
    import ringreduce.elastic

    monkeypatch.setenv("RINGREDUCE_ELASTIC_DRIVER", "127.0.0.1:1")
    monkeypatch.setattr(rr, "shutdown", lambda: None)
    monkeypatch.setattr(rr, "_reinit", lambda: None)

    def body(c):
        with hvd.use_communicator(c):
            model = torch.nn.Linear(3, 2)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           backward_passes_per_step=2)
            model(torch.ones(1, 3)).sum().backward()  # one of two passes: partial
            ringreduce.elastic.reset()
            model.zero_grad()  # the module's: the optimizer's pass count is reset's to drop
            grads_gone = all(p.grad is None for p in model.parameters())
            for _ in range(2):  # a whole step again (a count not reset: the 3rd pass raises)
                model(torch.ones(1, 3)).sum().backward()
            opt.step()
            return grads_gone, model.weight.grad.clone()

    [(gone, grad)] = run_threaded(1, body, timeout=20)
    assert gone and torch.equal(grad, torch.full((2, 3), 2.0))


# -------------------------------------------------------------------- launched
def worker_logs(job) -> dict[str, list[dict]]:
    """Each worker's events (by worker id: ranks change between generations)."""
    out: dict[str, list[dict]] = {}
    for path in sorted(job.log_dir.glob("w*.log")):
        out[path.stem] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def events(log: list[dict], ev: str) -> list[dict]:
    return [e for e in log if e["ev"] == ev]


def check_finished(job, logs: dict, finishers: list[str]) -> None:
    assert not job.timed_out and job.procs[0].returncode == 0, job.describe()
    done = {w: events(logs[w], "done") for w in finishers}
    assert all(len(d) == 1 for d in done.values()), (done, job.describe())
    final = [d[0] for d in done.values()]
    assert len({e["params"] for e in final}) == 1  # bitwise-identical parameters
    assert {(e["step"], e["epoch"]) for e in final} == {(final[0]["step"], 2)}
    for w in finishers:
        steps = events(logs[w], "step")
        assert all(e["err"] < 1e-6 for e in steps), w  # averaged like a plain allreduce
        assert all(e["in_buckets"] and e["stats"]["fallbacks"] == 0 for e in steps), w


@pytest.mark.timeout(90)
def test_worker_killed_mid_training_survivors_resume_from_commit():
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1"), [PYTHON, WORKER, "kill"],
                      timeout=60)
    gens = generations(job)
    assert gens == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c"]], job.describe()
    logs = worker_logs(job)
    assert len(events(logs["w2"], "done")) == 0
    check_finished(job, logs, ["w1", "w3"])
    for w in ("w1", "w3"):
        starts = events(logs[w], "start")
        assert [s["size"] for s in starts] == [3, 2], starts
        # the retry starts from the last commit of generation 0, and the sampler with it
        commits = [e for e in events(logs[w], "commit") if e["t"] < starts[1]["t"]]
        last = commits[-1]
        assert starts[1]["step"] == last["step"] == 6 and starts[1]["epoch"] == last["epoch"] == 1
        assert starts[1]["processed"] == last["processed"] and len(last["processed"]) == 24
        assert not set(starts[1]["share"]) & set(last["processed"])
    assert events(logs["w1"], "start")[1]["params"] == events(logs["w3"], "start")[1]["params"]
    assert "reset 1 (PeerLostError" in job.procs[0].stderr


@pytest.mark.timeout(90)
def test_host_added_new_worker_joins_at_commit(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\n")
    job = run_elastic(elastic_args(2, 3, discovery=hosts), [PYTHON, WORKER, "grow"],
                      timeout=60, env={"ELASTIC_DISCOVERY": hosts})
    gens = generations(job)
    assert gens == [["w1@a", "w2@b"], ["w1@a", "w2@b", "w3@c"]], job.describe()
    logs = worker_logs(job)
    check_finished(job, logs, ["w1", "w2", "w3"])
    new = events(logs["w3"], "start")
    assert len(new) == 1 and new[0]["size"] == 3 and new[0]["step"] == 3
    old = events(logs["w1"], "start")
    assert [s["size"] for s in old] == [2, 3]
    assert new[0]["params"] == old[1]["params"] != old[0]["params"]  # rank 0's, by sync()
    assert new[0]["processed"] == old[1]["processed"] and len(new[0]["processed"]) == 24
    grown = [e for e in events(logs["w3"], "step")]
    assert grown and all(e["size"] == 3 for e in grown)
    assert "reset 1 (hosts were added or removed)" in job.procs[0].stderr
