"""ringreduce.jax (and optax) in real processes: every collective eagerly and inside
jax.jit, their gradients, DistributedOptimizer against one process, the broadcasts (weak
types, typed PRNG keys), checkpoints (dtypes with x64 on and off), errors, and a rank
dying inside a jitted step. One launch per case: JAX imports slowly, so each worker runs
every check (tests/workers/jax_worker.py)."""

from __future__ import annotations

import re

import pytest
from procs import ROOT, require_mpirun, run_env_launch, run_mpi
from script_jobs import Script, run_scripts

pytest.importorskip("jax")
pytest.importorskip("optax")


def test_jax_collectives_optimizer_and_checkpoints(tmp_path):
    # three ranks (the worker has no code that depends on the size, and an odd one finds
    # more; the other JAX jobs here run two)
    n = 3
    # two host devices: the worker checks that results stay on the device they came from
    job = run_mpi(n, "jax_worker.py", [tmp_path, "check"], timeout=180,
                  env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    job.check_ok(expect_ranks=n)
    for r in range(n):
        eq = {e["opt"]: e["diff"] for e in job.events("equivalence")[r]}
        assert set(eq) == {"sgd", "adam", "sgd-k2"} and max(eq.values()) < 1e-5, eq
    assert job.event(0, "checkpoint")["files"] == ["ckpt.pkl"]


def test_a_rank_dying_inside_a_jitted_step_raises_peer_lost(tmp_path):
    # the env-var launch: mpirun would kill rank 0 as soon as rank 1 exits
    job = run_env_launch(2, "jax_worker.py", [tmp_path, "die"], timeout=120)
    assert not job.timed_out, job.describe()
    err = job.event(0, "step-error")
    assert err is not None, job.describe()
    assert err["cls"] == "PeerLostError" and err["rr"], err
    assert "rank 1" in err["msg"], err
    assert job.event(0, "step-error-after")["seconds"] < 30


@pytest.mark.timeout(300)
def test_jax_example_trains_checkpoints_and_resumes(tmp_path):
    """Trains, then resumes the finished run (no epoch trains, the same accuracy): one
    launch runs both (tests/script_jobs.py)."""
    pytest.importorskip("sklearn")
    require_mpirun()
    script, ckpt = ROOT / "examples" / "jax_train.py", tmp_path / "ckpt"
    job = run_scripts(2, [Script("train", script, ["--checkpoint-dir", ckpt], ckpt),
                          Script("resume", script, ["--checkpoint-dir", ckpt, "--resume"],
                                 ckpt)], tmp_path, {}, 240)
    out = job.check("train").output()
    acc = [float(a) for a in re.findall(r"final test accuracy: ([0-9.]+)", out)]
    assert len(acc) == 1 and acc[0] >= 0.95, out
    assert job.check("train").files() == ["ckpt.pkl"]
    again = job.check("resume").output()
    assert "epoch " not in again, again
    assert f"final test accuracy: {acc[0]:.4f}" in again, again
