"""Elastic Keras (``ringreduce.keras.elastic``) on every Keras backend: TensorFlow, torch
and JAX, Horovod's ``KerasState`` + ``model.fit`` + elastic callbacks recipe.

In one process per backend (torch, JAX: a process picks its Keras backend once; the
TensorFlow checks run in pytest's own, in tests/test_elastic_tensorflow.py): save,
restore, sync, an unbuilt optimizer, commits in the middle of an epoch and a failed
``fit`` rolled back. Then one launched job per backend: three workers on fake hosts, the
one on host ``b`` killed in epoch 1; on TensorFlow the survivors go on at size 2, on torch
and JAX a new worker on a spare host ``d`` replaces it (and must get everything from rank 0
through ``KerasState.sync()``). The weights are checked against a numpy float64 replay of
the steps that should have been kept (see tests/workers/elastic_tf_worker.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from elastic_jobs import elastic_args, generations, run_elastic
from procs import PYTHON, WORKERS, Job, run_single

WORKER = str(WORKERS / "elastic_tf_worker.py")
EPOCHS, STEPS, BATCH = 4, 6, 8  # as in the worker
COMMIT_EVERY, DIE_AFTER = 3, 4  # as in the worker: the survivors lose batches 3 and 4


def need(backend: str) -> None:
    """Skip unless keras and the backend are installed (without importing them here:
    torch and TensorFlow take seconds to import, and the workers do it anyway)."""
    for module in ("keras", backend):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The worker's ``data``: rank ``seed``'s samples."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]


def _gradients(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradients of the mean squared error of the worker's MLP (Dense(8, tanh), Dense(1))."""
    w1, b1, w2, b2 = params
    h = np.tanh(x @ w1 + b1)
    d_out = 2 * (h @ w2 + b2 - y) / y.size
    d_h = d_out @ w2.T * (1 - h ** 2)
    return [x.T @ d_h, d_h.sum(0), h.T @ d_out, d_out.sum(0)]


def adam_reference(start: list, schedule: list[tuple[int, int]], lr: float = 0.01
                   ) -> list[np.ndarray]:
    """The MLP after one Keras Adam step per ``(size, batch)`` of ``schedule``, in float64:
    the gradients of ranks ``0..size-1`` on their batch number ``batch``, averaged."""
    params = [np.array(p, np.float64) for p in start]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    ranks = [tuple(a.astype(np.float64) for a in data(STEPS * BATCH, r)) for r in range(3)]
    for t, (size, batch) in enumerate(schedule, start=1):
        rows = slice(batch * BATCH, (batch + 1) * BATCH)
        grads = [sum(g) / size for g in zip(*(_gradients(params, x[rows], y[rows])
                                              for x, y in ranks[:size]))]
        alpha = lr * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        for p, mi, vi, g in zip(params, m, v, grads):
            mi += (g - mi) * 0.1
            vi += (g * g - vi) * 0.001
            p -= alpha * mi / (np.sqrt(vi) + 1e-7)
    return params


def _events(job: Job) -> list[dict]:
    out = []
    for path in sorted(Path(job.log_dir).glob("w*.log")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_state_in_one_process(backend: str) -> None:
    need(backend)
    job = run_single(WORKER, ["check", backend], timeout=50)
    assert job.procs[0].returncode == 0 and f"CHECKS OK {backend}" in job.procs[0].stdout, \
        job.describe()


def _after(events: list[dict], ev: str, t: float) -> list[dict]:
    return [e for e in events if e["ev"] == ev and e["t"] > t]


def _check_resumed(job: Job, events: list[dict], hosts: list[str]) -> list[dict]:
    """The run as planned: b died once; the workers on ``hosts`` (survivors and any new
    one) resumed epoch 1 from the commit after its batch COMMIT_EVERY - 1, at one rank
    each, and finished with the same weights. Their 'done' events."""
    info = job.procs[0].describe()
    dying = [e for e in events if e["ev"] == "dying"]
    assert [e["host"] for e in dying] == ["b"], info
    assert "reset 1 (PeerLostError" in job.procs[0].stderr, info
    resumed = _after(events, "attempt", dying[0]["t"])
    assert sorted(e["host"] for e in resumed) == hosts, info
    assert sorted(e["rank"] for e in resumed) == list(range(len(hosts))), resumed
    kept = STEPS + COMMIT_EVERY  # iterations at the last commit
    assert all((e["size"], e["epoch"], e["batch"], e["iterations"]) == (len(hosts), 1,
               COMMIT_EVERY, kept) for e in resumed), resumed
    epochs = _after(events, "epoch", dying[0]["t"])
    assert min(epochs, key=lambda e: e["t"])["epoch"] == 1, epochs
    done = [e for e in events if e["ev"] == "done"]
    assert sorted(e["host"] for e in done) == hosts, info
    assert len({e["weights"] for e in done}) == 1, done  # model and optimizer, bitwise
    assert all((e["epoch"], e["batch"], e["iterations"]) == (EPOCHS, 0, kept + (EPOCHS - 1)
                                                             * STEPS) for e in done), done
    return done


def _check_replay(events: list[dict], done: list[dict], size: int) -> None:
    """The weights are where a numpy replay ends: epoch 0 and the committed batches of
    epoch 1 at size 3, then epochs 1.. again at ``size`` (not keeping the lost batches)."""
    start = next(e["weights"] for e in events if e["ev"] == "start")  # w1's, after sync
    epoch = [(3, s) for s in range(STEPS)]
    again = [(size, s) for s in range(STEPS)] * (EPOCHS - 1)
    want = adam_reference(start, epoch + [(3, s) for s in range(COMMIT_EVERY)] + again)
    got = [np.array(v) for v in done[0]["values"]]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    # Keeping the lost batches instead of rolling back would end elsewhere.
    kept = adam_reference(start, epoch + [(3, s) for s in range(DIE_AFTER + 1)] + again)
    assert max(np.abs(g - k).max() for g, k in zip(got, kept)) > 1e-3


@pytest.mark.timeout(100)
@pytest.mark.parametrize("backend", ["tensorflow"])
def test_keras_fit_survives_a_dead_worker(backend: str) -> None:
    """Three workers on hosts a, b, c; b's dies after batch 4 of epoch 1: a and c go back
    to the commit before batch 3 (not to epoch 0, not keeping batches 3-4), train epoch 1
    again from its first batch at size 2, and end where a numpy replay of exactly that
    ends. (torch and JAX: the job below, where a new worker replaces b's.)"""
    need(backend)
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1"),
                      [PYTHON, WORKER, "keras", backend], timeout=90)
    assert job.procs[0].returncode == 0, job.procs[0].describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c"]], job.describe()
    events = _events(job)
    done = _check_resumed(job, events, ["a", "c"])
    assert {e["backend"] for e in done} == {backend}
    _check_replay(events, done, 2)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_fit_takes_a_new_worker_mid_run(backend: str) -> None:
    """As above with a spare host d: when b's worker dies, ringrun starts w4 on d, and
    the next generation waits for it (one forms only when every live worker waits): w1,
    w3 and the new w4 at size 3, w4 at rank 2 with rank 2's data. ``KerasState.sync()``
    gives w4 rank 0's model, optimizer state and epoch/batch; then it trains in lockstep:
    all three end bitwise equal, where a numpy replay of that schedule ends."""
    need(backend)
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1,d:1"),
                      [PYTHON, WORKER, "keras", backend], timeout=90)
    assert job.procs[0].returncode == 0, job.procs[0].describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c", "w4@d"]], \
        job.describe()
    events = _events(job)
    assert [e["wid"] for e in events if e["ev"] == "attempt" and e["host"] == "d"] == ["w4"]
    done = _check_resumed(job, events, ["a", "c", "d"])
    assert {e["backend"] for e in done} == {backend}
    _check_replay(events, done, 3)
