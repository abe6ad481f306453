"""ringreduce.lightning: PyTorch Lightning's Trainer on ringreduce, in real processes (one
launch runs every case; Lightning's import costs ~3 CPU-seconds a process), and
examples/lightning_train.py under real ``mpirun -np 2`` (three runs in one job)."""

from __future__ import annotations

import pytest
from procs import PYTHON, ROOT, WORKERS, base_env, require_mpirun, run_env_launch, run_procs
from script_jobs import Script, final_accuracy, run_scripts

pytest.importorskip("lightning")
pytest.importorskip("torch")
pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every case, then rank 1 exits inside ``fit``."""
    job = run_env_launch(2, "lightning_worker.py", [tmp_path_factory.mktemp("ckpt")],
                         timeout=240)
    assert not job.timed_out, job.describe()
    assert job.event(1, "fit-error") is None, job.describe()  # rank 1 exited 17, not raised
    assert [p.returncode for p in job.procs] == [3, 17], job.describe()
    logs = job.logs()
    assert all(f"OK rank {r}" in logs.get(r, []) for r in range(2)), job.describe()
    return job


def test_trainer_fit_equals_one_process_on_the_union_of_batches(job):
    for r in range(2):
        eq = {e["case"]: e for e in job.events("equivalence")[r]}
        assert set(eq) == {"plain", "accumulate-clip", "horovod-lr", "manual",
                           "pytorch_lightning"}, eq
        for case, e in eq.items():
            # float64: the sum of two rank means against one mean of the union
            assert e["diff"] <= 1e-12 and e["spread"] == 0, (case, e)
            assert e["optimizer"] == "SGD" and e["distributed"], e  # DistributedOptimizer's SGD
        # 48 rows, 2 ranks, batches of 4: 6 steps an epoch; accumulating 2: 3
        assert [eq[c]["steps"] for c in ("plain", "accumulate-clip", "manual")] == [12, 6, 12]
        # float16 autocast, GradScaler at 1024: unscaled after the average (2.8e-4 measured;
        # unscaling the local gradients before it would step on 1024x averages)
        amp = job.event(r, "amp")
        assert amp["diff"] < 5e-3 and amp["spread"] == 0 and amp["scale"] == 1024, amp
        # manual optimization: accumulation over two manual_backward passes with
        # self.clip_gradients (on the averages), and two optimizers whose first loss
        # reaches the second's parameters (dropped by its zero_grad)
        manual = job.event(r, "manual-patterns")
        assert manual["accumulation"] <= 1e-12 and manual["two_optimizers"] <= 1e-12, manual
        # HorovodStrategy, also as "horovod" in pytorch_lightning's registry: lr x size
        assert eq["plain"]["lr"] == 0.1 and eq["horovod-lr"]["lr"] == eq[
            "pytorch_lightning"]["lr"] == pytest.approx(0.2)


def test_fabric_loop_with_accumulation_and_clipping_equals_one_process(job):
    for r in range(2):
        f = job.event(r, "fabric")
        # the user's loop: two batches per step, the first under no_backward_sync (nothing
        # in flight after it), clip_gradients on the averages (clipping the local ones
        # would be overwritten by the averages, unclipped), then step
        assert f["diff"] <= 1e-12 and f["spread"] == 0 and f["quiet"], f
        assert (f["mean"], f["total"], f["gathered"]) == (0.5, 1.0, [[0.0], [1.0]]), f
        assert f["broadcast"] == {"from": 1} and f["world"] == [2, r] and f["saved"], f
    # clip_gradients, then zero_grad() without a step, twice: each clip on that pass's
    # averages (the same on both ranks; each rank's own rows would give another norm)
    norms = [job.event(r, "fabric")["norms"] for r in range(2)]
    assert norms[0] == norms[1] and norms[0][0] != norms[0][1], norms


def test_logging_callbacks_and_checkpoints_agree_across_ranks(job):
    cb = [job.event(r, "callbacks") for r in range(2)]
    for r, c in enumerate(cb):
        assert c["world"] == [2, r, r == 0], c
        # sync_dist, and a torchmetrics MeanMetric (synchronized through ringreduce, not
        # torch.distributed): the mean of the ranks' 0 and 1
        assert c["rank_mean"] == 0.5 and c["metric_mean"] == 0.5, c
        # torchmetrics' dist_sync_fn: shapes that differ between the ranks
        assert c["uneven"] == [[[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0]]], c
        # all_gather stacks; sync_grads: d(sum of 3 x_r over ranks)/dx = 3 on each rank,
        # summed over the 2 ranks as torch.distributed's all_gather gradient is
        assert c["gathered"] == [[0.0, 0.0], [1.0, 2.0]] and c["gathered_grad"] == 6.0, c
        assert c["validated"] == pytest.approx(c["tested"], abs=0), c
        assert c["predicted"] == 24, c  # predict: each rank its half of the 48 rows
    # EarlyStopping: only rank 0's metric stops improving (after epoch 1); the decision is
    # shared, so both ranks stop at the same epoch instead of one waiting forever
    assert cb[0]["epochs"] == cb[1]["epochs"] == 2, cb
    assert cb[0]["val_loss"] == cb[1]["val_loss"], cb
    assert cb[0]["best"] == cb[1]["best"] == "best.ckpt" and cb[0]["files"] == ["best.ckpt"]


def test_refusals_name_the_rank_and_the_fix(job):
    caught = job.event(0, "refusals")["caught"]
    assert set(caught) == {"group", "op", "scheduler"}, caught
    assert "rank 0: RingreduceStrategy.reduce: process groups" in caught["group"]
    assert "'median'" in caught["op"]
    assert "accumulate_grad_batches=k" in caught["scheduler"]


def test_devices_in_a_process_no_launcher_started_are_refused(tmp_path):
    # ``python train.py`` with devices=2: DDP would start processes, this strategy none
    job = run_procs([("alone", [PYTHON, str(WORKERS / "lightning_worker.py"),
                                "--devices-alone"], base_env(log_dir=tmp_path))], 120, tmp_path)
    assert not job.timed_out, job.describe()
    caught = job.event(0, "devices")["caught"]
    for what, name in (("trainer", "RingreduceStrategy"), ("fabric", "RingreduceFabricStrategy")):
        assert caught[what].startswith(f"rank 0: {name}: devices=2 in a job of one process"), \
            caught


def test_a_rank_dying_inside_fit_raises_on_the_others(job):
    err = job.event(0, "fit-error")
    assert err is not None, job.describe()
    assert err["cls"] == "PeerLostError" and err["rr"], err
    assert "rank 1" in err["msg"] and "has exited" in err["msg"], err
    assert job.event(0, "fit-error-after")["seconds"] < 30


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    require_mpirun()
    work = tmp_path_factory.mktemp("lightning-examples")
    script = ROOT / "examples" / "lightning_train.py"
    resumed, fresh = work / "resumed", work / "fresh"
    return run_scripts(2, [
        Script("first", script, ["--epochs", 6, "--checkpoint-dir", resumed], resumed),
        Script("resume", script, ["--epochs", 10, "--checkpoint-dir", resumed, "--resume"],
               resumed),
        Script("fresh", script, ["--epochs", 10, "--checkpoint-dir", fresh], fresh),
    ], work, {}, 300)


@pytest.mark.timeout(360)
def test_lightning_example_trains_and_resumes_exactly(examples):
    fresh = examples.check("fresh")
    acc = final_accuracy(fresh)
    assert acc >= 0.95, fresh.output()
    assert "epochs 10," in fresh.output()
    # rank 0 alone wrote them: the best epoch (ModelCheckpoint's default) and last.ckpt
    assert fresh.files() == ["epoch=9-step=230.ckpt", "last.ckpt"], fresh.files()
    first, resumed = examples.check("first"), examples.check("resume")
    assert "epochs 6," in first.output() and "epochs 10," in resumed.output()
    # epochs 7-10 from last.ckpt (weights, momentum, the LR schedule, the sampler's
    # epoch) land where ten epochs in one go do
    assert final_accuracy(resumed) == acc, (resumed.output(), fresh.output())
    import torch

    weights = [torch.load(run.cwd / "last.ckpt", weights_only=False)["state_dict"]
               for run in (resumed, fresh)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
