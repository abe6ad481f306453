"""Elastic training with TensorFlow 2 and Keras 3 (ringreduce.tensorflow.elastic,
ringreduce.keras.elastic): states and callbacks in one process, then an elastic job on
fake hosts (a host joins a custom training loop). The launched ``model.fit`` job, on every
Keras backend, is in tests/test_elastic_keras.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from elastic_jobs import elastic_args, generations, run_elastic  # noqa: E402
from procs import PYTHON, WORKERS  # noqa: E402

import ringreduce as rr  # noqa: E402
import ringreduce.keras as rk  # noqa: E402
import ringreduce.tensorflow as rt  # noqa: E402
from ringreduce.elastic import recoverable  # noqa: E402
from ringreduce.exceptions import InvalidInputError, PeerLostError  # noqa: E402
from ringreduce.tensorflow._bridge import call  # noqa: E402

WORKER = str(WORKERS / "elastic_tf_worker.py")
EPOCHS, STEPS = 4, 6  # as in the worker


@pytest.fixture
def solo():
    """ringreduce initialized as a job of one process."""
    rr.init()
    yield
    rr.shutdown()


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model


def _values(variables: list) -> list:
    return [np.array(v.numpy()) for v in variables]


def _train(model: keras.Model, epochs: int = 1, **kwargs: object) -> None:
    x = np.ones((8, 3), np.float32)
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, epochs=epochs, verbose=0,
              **kwargs)


def test_keras_state_save_restore_builds_optimizer(solo) -> None:
    model = _model()
    state = rk.elastic.KerasState(model, epoch=0)
    assert model.optimizer.built  # built from the model at once: same variables everywhere
    state.epoch = 3
    state.commit()
    saved = _values(model.variables + model.optimizer.variables)
    _train(model)
    assert int(model.optimizer.iterations.numpy()) == 2
    state.epoch = 5
    state.restore()
    assert state.epoch == 3
    for a, b in zip(saved, _values(model.variables + model.optimizer.variables)):
        np.testing.assert_array_equal(a, b)
    state.sync()  # one rank: rank 0's values are its own
    assert state.epoch == 3
    assert tf.__version__ and rt.elastic.TensorFlowKerasState is rk.elastic.KerasState


def test_tensorflow_state_and_refusals(solo) -> None:
    v = tf.Variable([1.0, 2.0])
    state = rt.elastic.TensorFlowState([v], step=1)
    v.assign([5.0, 6.0])
    state.step = 7
    state.restore()
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert state.step == 1
    with pytest.raises(InvalidInputError, match="pass the variables"):
        rt.elastic.TensorFlowState()
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(InvalidInputError, match="must be built"):
        rk.elastic.KerasState(unbuilt)


def test_peer_lost_wrapped_by_tf_function_is_recoverable() -> None:
    err = PeerLostError("rank 1 (worker w2) vanished: test")

    def body(arrays):
        raise err  # the bridge remembers it as it passes it to TensorFlow

    @tf.function
    def step():
        return call(body, [tf.constant(1.0)], [tf.float32], "test")

    with pytest.raises(tf.errors.OpError) as info:
        step()
    assert not isinstance(info.value, PeerLostError) and recoverable(info.value)
    assert not recoverable(tf.errors.UnknownError(None, None, "something else"))

    calls = []

    @rt.elastic.run
    def train(state):
        calls.append(state.epoch)
        return step()

    # Outside an elastic job: not retried, and raised as ringreduce's own error.
    with pytest.raises(PeerLostError):
        train(rr.elastic.ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0, epoch=2))
    assert calls == [2]


def test_keras_callbacks_track_epochs_and_batches(solo) -> None:
    model = _model()
    state = rk.elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    state.save = lambda real=state.save: (commits.append((state.epoch, state.batch)), real())
    callbacks = [rk.elastic.CommitStateCallback(state, batches_per_commit=1),
                 rk.elastic.UpdateBatchStateCallback(state),
                 rk.elastic.UpdateEpochStateCallback(state)]
    _train(model, epochs=2, callbacks=callbacks)
    assert (state.epoch, state.batch) == (2, 0)
    # Committed after each batch's callbacks, whatever their order: the commit callback
    # comes first in the list and still sees the batch and epoch counted.
    assert commits == [(0, 1), (1, 0), (1, 1), (2, 0)]  # a batch's and its epoch's: one
    _train(model, epochs=3, initial_epoch=state.epoch, callbacks=callbacks)
    assert state.epoch == 3
    _train(model, epochs=5 - state.epoch, callbacks=callbacks)  # Horovod's examples' way
    assert state.epoch == 5
    with pytest.raises(InvalidInputError):
        rk.elastic.CommitStateCallback(state, batches_per_commit=0)


def _events(job) -> list[dict]:
    out = []
    for path in sorted(Path(job.log_dir).glob("w*.log")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


@pytest.mark.timeout(100)
def test_custom_loop_new_host_gets_rank0_state(tmp_path: Path) -> None:
    """A custom TF2 loop on hosts a, b; rank 0 adds host c to the discovery file: every
    worker rejoins at its next commit, and c's worker starts from rank 0's weights and
    Adam state (its own optimizer not built yet) through sync()."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\n")
    job = run_elastic(elastic_args(2, 3, discovery=hosts),
                      [PYTHON, WORKER, "loop", str(hosts)], timeout=90)
    info = job.procs[0].describe()
    assert job.procs[0].returncode == 0, info
    gens = generations(job)
    assert [len(g) for g in gens][:1] == [2] and len(gens[-1]) == 3, info
    events = _events(job)
    new = [e for e in events if e["host"] == "c"]
    before = next(e for e in new if e["ev"] == "before")
    assert not before["built"], before
    attempts = [e for e in events if e["ev"] == "attempt" and e["size"] == 3]
    assert sorted(e["host"] for e in attempts) == ["a", "b", "c"], info
    assert len({(e["weights"], e["iterations"], e["epoch"], e["step"]) for e in attempts}) == 1
    assert attempts[0]["iterations"] >= STEPS and attempts[0]["epoch"] >= 1, attempts
    assert before["model"] != next(e["model"] for e in attempts if e["host"] == "c")
    done = [e for e in events if e["ev"] == "done"]
    assert len(done) == 3 and len({e["weights"] for e in done}) == 1, done
    assert all(e["iterations"] == EPOCHS * STEPS and e["epoch"] == EPOCHS for e in done), done


def test_sizes_in_elastic_graphs_are_read_when_they_run(solo, monkeypatch) -> None:
    """A traced step outlives a reset: in an elastic job size_op() is read at run time."""
    traced = tf.function(lambda: rt.size_op())
    assert "Const" in [op.type for op in traced.get_concrete_function().graph.get_operations()]
    monkeypatch.setenv("RINGREDUCE_ELASTIC_DRIVER", "127.0.0.1:1")
    traced = tf.function(lambda: rt.size_op())
    ops = [op.type for op in traced.get_concrete_function().graph.get_operations()]
    assert "EagerPyFunc" in ops and int(traced()) == 1


def test_broadcast_callback_broadcasts_again_after_a_reset(solo) -> None:
    """Workers that join build the callback afresh: the old ones must broadcast too."""
    model = _model()
    callback = rk.callbacks.BroadcastGlobalVariablesCallback(0)
    _train(model, callbacks=[callback])
    first = callback._done_on
    assert callback.broadcast_done and first is rr._comm()
    _train(model, callbacks=[callback])
    assert callback._done_on is first  # same communicator: once is enough
    rr.shutdown()
    rr.init()
    _train(model, callbacks=[callback])
    assert callback._done_on is rr._comm() and callback._done_on is not first
