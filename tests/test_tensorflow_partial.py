"""Horovod's model-parallel local layers (PartialDistributedGradientTape, ringreduce.keras's
PartialDistributedOptimizer, register_local_source / register_local_var, the TF1 optimizer)
at -np 2 in real processes: one launch, one TensorFlow import per rank for every case
(tests/workers/partial_worker.py)."""

from __future__ import annotations

import pytest
from procs import run_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

CASES = {"partial_tape.function": True, "register_local_source.eager": False,
         "keras.loop": True, "keras.fit": True, "keras.register_local_var.fit": False,
         "tf1": True}  # case -> scale_local_gradients


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job = run_mpi(2, "partial_worker.py", [], timeout=150, env={"KERAS_BACKEND": "tensorflow"})
    job.check_ok(expect_ranks=2)
    return job


def test_local_layers_keep_their_own_scaled_gradients_and_shared_ones_are_averaged(job):
    for r in range(2):
        cases = {e["case"]: e for e in job.events("case")[r]}
        assert {c: e["scale"] for c, e in cases.items()} == CASES
        for case, e in cases.items():
            # the TF1 graph's float64 arithmetic differs from eager TensorFlow's by ~1e-9
            # without ringreduce (measured: one plain GradientDescentOptimizer step)
            tol = 1e-7 if case == "tf1" else 1e-12
            # shared weights: the reference of averaged gradients, the same on both ranks
            assert e["shared_ref"] <= tol and e["shared_spread"] == 0.0, e
            # local weights: this rank's own gradients, over size() iff scaling ...
            assert e["local_ref"] <= tol, e
            # ... which the other scaling would not give, and they differ between ranks
            assert e["local_other_scaling"] > 1e-3 and e["local_spread"] > 1e-3, e


def test_ranks_that_register_different_local_positions_get_a_mismatch_error(job):
    # same shapes: without the layout marker rank 0's gradient of b would silently be
    # averaged with rank 1's gradient of a
    for r in range(2):
        e = job.event(r, "mismatch")
        assert e.get("cls") == "MismatchError" and e["rr"], e
        assert "DistributedGradientTape" in e["msg"], e


def test_bad_local_layers_are_refused_naming_what_was_passed(job):
    for r in range(2):
        e = job.event(r, "bad-args")
        for what in ("tape", "optimizer"):
            for label, shown in [("str", "str 'dense'"), ("int", "got int 3"),
                                 ("list-with-int", "the list holds int 3"), ("dict", "dict")]:
                cls, msg = e[f"{what}.{label}"]
                assert cls == "InvalidInputError" and shown in msg, (what, label, msg)
                assert "local_layers" in msg


def test_the_broadcast_callback_leaves_local_variables_alone():
    # Horovod 0.28's BroadcastGlobalVariablesCallback(local_variables=...), ranks as threads
    import keras
    import numpy as np

    import ringreduce.keras as rk
    from ringreduce.testing import make_world, run_threaded

    comms = make_world(2)

    def body(c):
        with rk.use_communicator(c):
            shared, local = keras.layers.Dense(2), keras.layers.Dense(1)
            model = keras.Sequential([keras.Input((3,)), shared, local])
            for v in model.variables:
                v.assign(np.full(v.shape, float(c.rank() + 1), np.float32))
            cb = rk.callbacks.BroadcastGlobalVariablesCallback(
                0, local_variables=local.trainable_weights)
            cb.set_model(model)
            cb.on_train_begin()
            return [np.asarray(v.numpy()) for v in shared.variables + local.variables]

    try:
        results = run_threaded(2, body, world=comms, timeout=60)
    finally:
        for c in comms:
            c.close()
    for r, values in enumerate(results):
        assert all((v == 1.0).all() for v in values[:2]), values  # rank 0's
        assert all((v == r + 1.0).all() for v in values[2:]), values  # its own
