"""SyncBatchNormalization (ringreduce.tensorflow / ringreduce.keras) on the TensorFlow backend,
ranks as threads in this process (one TensorFlow import, shared with the other TensorFlow
modules): BatchNormalization on the union of unequal per-rank batches, eagerly and in
tf.function; inference and size 1 are BatchNormalization; Horovod's names and refusals.
The same cases run on the torch and JAX backends, and model.fit with it, in real processes
(test_keras_multiprocess.py, through workers/keras_worker.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("the Keras backend is not TensorFlow", allow_module_level=True)

import ringreduce as rr  # noqa: E402
import ringreduce.keras as rk  # noqa: E402
import ringreduce.tensorflow as rtf  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import sync_bn_cases  # noqa: E402

# a collective op blocks an inter-op thread until every rank's runs (see test_tensorflow_ops)
try:
    tf.config.threading.set_inter_op_parallelism_threads(8)
except RuntimeError:
    pass


@pytest.fixture(autouse=True)
def float64():
    # The dtype policy too: Keras caches the default one (from floatx) in this thread's
    # global state once any layer was made, e.g. by another module's tests.
    before, policy = keras.backend.floatx(), keras.config.dtype_policy()
    keras.backend.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.backend.set_floatx(before)
    keras.config.set_dtype_policy(policy)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_equals_batch_norm_on_the_union_of_unequal_batches(compiled):
    def body(c):
        with rtf.use_communicator(c):
            return sync_bn_cases.layer_cases(c.rank(), 2, c.allgather_object, compiled)

    for diffs in run_threaded(2, body, timeout=120):
        assert set(diffs) == set(sync_bn_cases.CASES)
        for case, d in diffs.items():
            assert max(d.values()) < 1e-12, (case, d)


def test_size_one_is_batch_norm():
    assert sync_bn_cases.single_rank_is_batch_norm() == 0.0


def test_inference_needs_no_other_rank():
    # inference mode runs no collective: one rank alone of two, no init needed
    layer = rk.SyncBatchNormalization()
    x = np.random.default_rng(0).normal(size=(4, 3))
    ref = keras.layers.BatchNormalization()
    np.testing.assert_array_equal(layer(x, training=False), ref(x, training=False))
    with pytest.raises(rr.NotInitializedError):
        layer(x, training=True)


def test_horovod_names_config_and_refusals(monkeypatch):
    import ringreduce.tensorflow.keras as hvd_keras
    from ringreduce.keras import sync_batch_norm

    assert rtf.SyncBatchNormalization is rk.SyncBatchNormalization
    assert hvd_keras.SyncBatchNormalization is rk.SyncBatchNormalization
    assert "SyncBatchNormalization" in rtf.__all__ and "SyncBatchNormalization" in rk.__all__
    layer = rtf.SyncBatchNormalization(momentum=0.9, epsilon=1e-4, fused=False)
    assert isinstance(layer, keras.layers.BatchNormalization)
    assert layer.name.startswith("sync_batch_normalization")
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(again) is rk.SyncBatchNormalization
    assert (again.momentum, again.epsilon) == (0.9, 1e-4)
    with pytest.raises(rr.InvalidInputError, match="fused=True"):
        rtf.SyncBatchNormalization(fused=True)
    # a Keras backend without a ringreduce layer: refused at the first training call
    monkeypatch.setattr(sync_batch_norm.keras.backend, "backend", lambda: "numpy")

    def body(c):
        with rtf.use_communicator(c):
            with pytest.raises(rr.InvalidInputError, match="'numpy' is not supported"):
                rtf.SyncBatchNormalization()(np.ones((2, 3)), training=True)

    run_threaded(2, body, timeout=60)
