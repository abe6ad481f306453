"""ringreduce.keras in real processes (the env-var launch): model.fit equivalence, callbacks,
checkpoints, load_model, and a rank dying inside model.fit, on the TensorFlow, torch and JAX
backends. One launch per backend runs every case (Keras imports cost ~10 CPU-seconds a
process); the dying rank comes last."""

from __future__ import annotations

import pytest
from procs import run_env_launch

pytest.importorskip("tensorflow")
pytest.importorskip("keras")


def backend_env(backend: str) -> dict:
    if backend != "tensorflow":
        pytest.importorskip(backend)
    # float64 models: JAX computes in float32 unless x64 is on
    return {"KERAS_BACKEND": backend, **({"JAX_ENABLE_X64": "1"} if backend == "jax" else {})}


@pytest.fixture(scope="module", params=["tensorflow", "torch", "jax"])
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def job(backend, tmp_path_factory):
    """One launch per backend: every case, then rank 1 exits inside ``fit``."""
    job = run_env_launch(2, "keras_worker.py", [tmp_path_factory.mktemp(backend)],
                         timeout=180, env=backend_env(backend))
    assert not job.timed_out, job.describe()
    assert job.event(1, "fit-error") is None, job.describe()  # rank 1 exited 17, not raised
    assert [p.returncode for p in job.procs] == [3, 17], job.describe()
    logs = job.logs()
    assert all(f"OK rank {r}" in logs.get(r, []) for r in range(2)), job.describe()
    return job


def test_keras_fit_equals_one_process_and_callbacks_work(job, backend):
    for r in range(2):
        eq = {(e["opt"], e["passes"], e["keras_steps"]) + (("embedding",) * e["embedding"]): e
              for e in job.events("equivalence")[r]}
        # tensorflow: also k=2 with an Embedding (IndexedSlices gradients, summed densely)
        assert set(eq) == {("sgd", 1, 0), ("adam", 1, 0), ("sgd", 2, 0), ("sgd", 1, 2)} | (
            {("sgd", 2, 0, "embedding")} if backend == "tensorflow" else set())
        tol = 1e-7 if backend == "torch" else 1e-10  # see keras_worker.equivalence
        assert all(e["diff"] <= tol for e in eq.values()), eq
        k2 = eq[("sgd", 2, 0)]
        # k=2: one application per two batches, as the reference's (jax: Keras's own
        # accumulation, whose iterations count applications too)
        assert k2["iterations"] == k2["ref_iterations"] == 4
        if backend == "tensorflow":
            emb = eq[("sgd", 2, 0, "embedding")]
            assert emb["iterations"] == emb["ref_iterations"] == 4, emb
        if backend == "jax":
            assert job.event(r, "accumulation-refusals")["ok"]
        # k=2 averages once per two batches: half the gradient allreduces of k=1 (the
        # broadcast callback's tensors are the same in both runs)
        assert k2["tensors"] < 0.75 * eq[("sgd", 1, 0)]["tensors"], eq
        # the user's own gradient_accumulation_steps=2: the same result; on jax the ranks
        # talk on update steps only (tensorflow, torch: apply averages every batch)
        if backend == "jax":
            assert eq[("sgd", 1, 2)]["tensors"] == k2["tensors"], eq
        # loss scaling: mixed_float16's LossScaleOptimizer and a user's; rank 1 overflowed
        scaled = {e["how"]: e for e in job.events("loss-scaling")[r]}
        assert set(scaled) == {"compile", "user"}, scaled
        assert all(e["spread"] == 0 and e["scale"] < e["initial"] for e in scaled.values())
        # a model Keras builds on its first batch: broadcast after it, ranks end equal
        # SyncBatchNormalization: BatchNormalization on the union of unequal batches
        # (outputs, gradients, moving statistics, inference), at size 1 exactly, in fit.
        # torch, jax: float32-level differences (measured 1.9e-6 on both, 3.6e-15 on
        # tensorflow); on torch Keras's BatchNormalization is itself 5e-7 from float64
        # arithmetic on these data in one process, up to 3e-5 in the input gradient
        sbn = job.event(r, "sync-bn")
        loose = backend != "tensorflow"
        assert sbn["single"] == (0.0 if r == 0 else None), sbn  # a one-rank world: rank 0's
        assert sbn["fit"] <= (1e-6 if loose else tol), sbn
        for case, d in sbn["layer"].items():
            assert max(d.values()) <= (1e-4 if loose else 1e-12), (case, d)
        lazy = job.event(r, "lazy")
        assert lazy["spread"] == {"same": 0.0, "different": 0.0}, lazy
        assert lazy["diff"] <= tol, lazy
    cb = [job.event(r, "callbacks") for r in range(2)]
    assert cb[0]["logs"] == cb[1]["logs"], "MetricAverageCallback left ranks' logs different"
    lrs = cb[0]["lrs"]  # 2 batches per epoch, warmup over 2 epochs from 0.08/2 to 0.08
    # Horovod's warmup runs one batch ahead: the last warmup batch is at the full rate
    assert lrs[:4] == pytest.approx([0.05, 0.06, 0.07, 0.08]) and lrs[4:] == [0.08, 0.08], lrs
    # staircase from epoch 1: epoch 0 keeps the rate warmup left (0.08); Horovod's decay
    # counts from start_epoch: 0.08 * 0.5 ** (epoch - 1) = 0.08, then 0.04
    schedule = job.event(0, "schedule")["lrs"]
    assert schedule == pytest.approx([0.08, 0.08, 0.08, 0.08, 0.04, 0.04]), schedule
    # BestModelCheckpoint(mode="max") on rank 0 only: its file holds the weights of the
    # epoch whose mean loss was highest; without a filepath, fit is refused on every rank
    # (both ranks read it: one host; their weights are equal)
    best = [{k: job.event(r, "best")[k] for k in ("worst", "kept", "files")} for r in range(2)]
    assert best == [{**best[0], "files": ["best.weights.h5"], "kept": 0.0}] * 2, best
    for r in range(2):
        assert "BestModelCheckpoint: no filepath" in job.event(r, "best-no-path")["error"]
    loaded = job.event(0, "loaded")
    assert loaded["same"] and loaded["distributed"] == "_DistributedKerasMixin"
    assert loaded["backend"] == backend
    assert loaded["files"] == ["ckpt.keras"], loaded
    h5 = job.event(0, "h5")
    assert h5 == {**h5, "magic": b"\x89HDF".hex(), "same": True}, h5


def test_a_rank_dying_inside_fit_raises_peer_lost_on_the_others(job):
    err = job.event(0, "fit-error")
    assert err is not None, job.describe()
    assert err["cls"] == "PeerLostError" and err["rr"], err
    assert "rank 1" in err["msg"], err
    assert job.event(0, "fit-error-after")["seconds"] < 30
