"""Elastic training with JAX (``ringreduce.jax.elastic.JaxState``): in one process, and a
launched job on fake hosts where a worker dies (see tests/elastic_jobs.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from elastic_jobs import elastic_args, generations, run_elastic
from procs import PYTHON, WORKERS

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import ringreduce.jax as hvd  # noqa: E402

RESULT = re.compile(r"RESULT (w\d+) rank (\d+) size (\d+) step (\d+) digest (\w+) w (\S+)")


def sgd_reference(sizes: list[int]) -> np.ndarray:
    """The worker's model after one step per entry of ``sizes`` (ranks 0..n-1 averaged)."""
    w, b = np.zeros(4), 0.0
    for step, n in enumerate(sizes):
        gw, gb = np.zeros(4), 0.0
        for r in range(n):
            rng = np.random.default_rng(1000 * step + r)
            x = rng.normal(size=(8, 4)).astype(np.float32).astype(np.float64)
            y = x @ np.arange(1, 5) + 0.5
            err = x @ w + b - y
            gw += 2 * x.T @ err / len(y)
            gb += 2 * err.mean()
        w, b = w - 0.1 * gw / n, b - 0.1 * gb / n
    return np.append(w, b)


@pytest.mark.timeout(120)
def test_jax_state_survives_a_killed_worker_with_donated_buffers():
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1"),
                      [PYTHON, str(WORKERS / "elastic_jax_worker.py"), "15", "die:w2:12"],
                      timeout=100)
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c"]], job.describe()
    out = {m.group(1): m.groups()[1:] for m in RESULT.finditer(job.procs[0].stdout)}
    assert sorted(out) == ["w1", "w3"], job.describe()
    assert out["w1"][3] == out["w3"][3], out  # bitwise the same parameters
    assert out["w1"][:3] == ("0", "2", "15"), out
    got = np.array([float(v) for v in out["w1"][4].split(",")])
    # steps 11-12 ran at size 3, were rolled back to the commit at 10 and ran again at 2
    np.testing.assert_allclose(got, sgd_reference([3] * 10 + [2] * 5), atol=1e-4)
    assert np.abs(got - sgd_reference([3] * 12 + [2] * 3)).max() > 5e-3  # not kept


@pytest.mark.timeout(120)
def test_a_replacement_worker_gets_rank_0s_jax_state():
    # w3 starts after w2 dies: its losses are [], rank 0's a list of floats; both must
    # sync them the same way (the choice of collective comes from the constructor)
    job = run_elastic(elastic_args(2, 3, np=2, hosts="a:1,b:1,c:1", extra=["--elastic-timeout",
                                                                           "20"]),
                      [PYTHON, str(WORKERS / "elastic_jax_worker.py"), "15", "die:w2:7"],
                      timeout=100)
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b"], ["w1@a", "w3@c"]], job.describe()
    out = {m.group(1): m.groups()[1:] for m in RESULT.finditer(job.procs[0].stdout)}
    assert sorted(out) == ["w1", "w3"] and out["w1"][3] == out["w3"][3], out
    got = np.array([float(v) for v in out["w3"][4].split(",")])
    np.testing.assert_allclose(got, sgd_reference([2] * 15), atol=1e-4)


def test_jax_state_save_restore_sync_in_one_process():
    hvd.init()
    try:
        key = jax.random.key(3)
        params = {"w": jnp.ones(3), "lr": jnp.asarray(0.5)}  # lr is weakly typed
        state = hvd.elastic.JaxState(params=params, key=key, epoch=2, names=["a"])

        @jax.jit
        def bump(p):
            return jax.tree_util.tree_map(lambda v: v + 1, p)

        state.params = jax.jit(bump, donate_argnums=0)(state.params)  # deletes the old ones
        state.epoch, state.names = 3, ["a", "b"]
        state.restore()
        np.testing.assert_array_equal(state.params["w"], np.ones(3))
        assert state.params["lr"].weak_type and (state.epoch, state.names) == (2, ["a"])
        state.sync()
        assert state.key.dtype == key.dtype and state.params["lr"].weak_type
        assert (state.epoch, state.names) == (2, ["a"])
    finally:
        hvd.shutdown()
