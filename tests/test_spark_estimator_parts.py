"""The Spark ML estimators' framework-neutral parts in one process, without a Spark
session (ringreduce/spark/_estimator.py, ringreduce/spark/common/store.py): params, column
checks, rows to arrays, the ranks' shares, a rank's batches, the store's layout. The fits
themselves run on a real Spark in tests/test_spark.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (the test extra has it)")

from pyspark.ml.linalg import DenseVector, VectorUDT  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    DoubleType,
    FloatType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from ringreduce.exceptions import InvalidInputError  # noqa: E402
from ringreduce.spark._estimator import RankData, assign, describe_columns, rows_to_arrays  # noqa: E402
from ringreduce.spark.common.store import LocalStore, Store  # noqa: E402
from ringreduce.spark.torch import TorchEstimator, TorchModel  # noqa: E402

SCHEMA = StructType([StructField("v", VectorUDT()), StructField("a", ArrayType(FloatType())),
                     StructField("d", DoubleType()), StructField("n", LongType()),
                     StructField("s", StringType())])


def test_params_are_horovods():
    est = TorchEstimator(num_proc=3, batch_size=4, feature_cols=["v"])
    assert (est.getNumProc(), est.getBatchSize(), est.getEpochs()) == (3, 4, 1)
    assert est.setEpochs(7) is est and est.getEpochs() == 7
    assert est.getPartitionsPerProcess() == 10 and est.getShuffle() is True
    assert est.copy().getFeatureCols() == ["v"]
    with pytest.raises(InvalidInputError, match="unknown argument.*batchsize"):
        TorchEstimator(batchsize=4)
    with pytest.raises(InvalidInputError, match="transformation_fn: not supported"):
        TorchEstimator(transformation_fn=lambda b: b)._spec(None, "TorchEstimator.fit")
    model = TorchModel(feature_columns=["v"], label_columns=["y"], history={"loss": [1.0]})
    assert model.getHistory() == {"loss": [1.0]} and model._output_names() == ["y__output"]


def test_columns_are_checked_by_name():
    cols = describe_columns(SCHEMA, ["v", "a", "d", "n"], "fit")
    assert [(c.dtype, c.vector) for c in cols] == [("float64", True), ("float32", True),
                                                   ("float64", False), ("int64", False)]
    with pytest.raises(InvalidInputError, match="'x' is not in the DataFrame"):
        describe_columns(SCHEMA, ["x"], "fit")
    with pytest.raises(InvalidInputError, match="'s' has type string"):
        describe_columns(SCHEMA, ["s"], "fit")


def test_rows_become_arrays():
    cols = describe_columns(SCHEMA, ["v", "a", "n"], "fit")
    got = rows_to_arrays([(DenseVector([1, 2]), [3.0, 4.0], 5), (DenseVector([6, 7]),
                                                                 [8.0, 9.0], 10)], cols)
    assert got["v"].tolist() == [[1, 2], [6, 7]] and got["a"].dtype == np.float32
    assert got["n"].tolist() == [5, 10] and got["n"].dtype == np.int64
    with pytest.raises(InvalidInputError, match="'v': rows hold vectors of different"):
        rows_to_arrays([(DenseVector([1]), [1.0], 1), (DenseVector([1, 2]), [1.0], 1)], cols)


def test_shares_are_balanced_and_none_is_empty():
    parts = [("a", 10), ("b", 7), ("c", 5), ("d", 4), ("e", 0)]
    shares = assign(parts, 2, "fit")
    rows = dict(parts)
    assert sorted(sum(rows[p] for p in s) for s in shares) == [12, 14]  # 10+4, 7+5
    with pytest.raises(InvalidInputError, match=r"rank\(s\) \[2\] would get no rows"):
        assign([("a", 3), ("b", 1)], 3, "fit")


def test_a_rank_takes_the_same_steps_whatever_its_share(tmp_path):
    np.savez(tmp_path / "p0.npz", x=np.arange(5), y=np.arange(5) * 2)
    np.savez(tmp_path / "p1.npz", x=np.arange(5, 7), y=np.arange(5, 7) * 2)
    data = RankData([str(tmp_path / "p0.npz"), str(tmp_path / "p1.npz")])
    assert data.rows == 7
    plain = [b["x"].tolist() for b in data.batches(0, 4, 3, False, 0)]
    assert plain == [[0, 1, 2], [3, 4, 5], [6, 0, 1], [2, 3, 4]]  # wraps around
    shuffled = [b for b in data.batches(1, 5, 3, True, 9)]
    assert len(shuffled) == 5 and all((b["y"] == 2 * b["x"]).all() for b in shuffled)
    seen = np.concatenate([b["x"] for b in shuffled])[:7]
    assert sorted(seen.tolist()) == list(range(7))  # every row once before any twice
    again = [b["x"].tolist() for b in data.batches(1, 5, 3, True, 9)]
    assert again == [b["x"].tolist() for b in shuffled]
    assert [len(b["x"]) for b in data.in_order(3)] == [3, 3, 1]


def test_store_layout(tmp_path):
    store = Store.create(f"file://{tmp_path}")
    assert isinstance(store, LocalStore) and store.prefix_path == str(tmp_path)
    assert store.get_checkpoint_path("r") == str(tmp_path / "runs" / "r" / "checkpoint.pkl")
    assert store.get_train_data_path("r").endswith("intermediate_train_data.r")
    with pytest.raises(InvalidInputError, match="hdfs://nn/x.*mounted path"):
        Store.create("hdfs://nn/x")


# Keras's own model.save converts TensorFlow variables with np.array (numpy 2 warns)
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_keras_estimator_refuses_and_ships_keras_objects():
    keras = pytest.importorskip("keras")
    from ringreduce.spark import keras as sk

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    est = sk.KerasEstimator(model=model, optimizer="sgd", loss="mse")
    with pytest.raises(InvalidInputError, match="optimizer must be a Keras optimizer"):
        est._payload()
    with pytest.raises(InvalidInputError, match="loss is required"):
        sk.KerasEstimator(model=model, optimizer=keras.optimizers.SGD())._payload()
    # a Keras loss travels as its config (as model.save would keep it), a name as it is
    wire = sk._to_wire([keras.losses.MeanSquaredError(reduction="sum"), "mae"],
                       keras.losses.Loss, "losses")
    back = sk._from_wire(wire, {})
    assert isinstance(back[0], keras.losses.MeanSquaredError) and back[0].reduction == "sum"
    assert back[1] == "mae"
    again = sk.load_model_bytes(sk.model_bytes(model))
    assert all((a.numpy() == b.numpy()).all() for a, b in zip(again.weights, model.weights))


def test_keras_checkpoint_callback_gives_only_a_best_file_this_fit_wrote(tmp_path):
    pytest.importorskip("keras")
    from ringreduce.keras.callbacks import BestModelCheckpoint
    from ringreduce.spark import keras as sk

    old = tmp_path / "best.keras"
    old.write_bytes(b"an earlier run's")
    mine = BestModelCheckpoint(filepath=str(old), initial_value_threshold=0.0)
    with sk._checkpoint_callback(mine, 0) as best:
        assert best.callback is mine and best.path == str(old)
        assert not best.written()  # never beaten: the earlier run's file is not this fit's
        replacement = tmp_path / "new"
        replacement.write_bytes(b"this fit's")
        replacement.replace(old)  # as ModelCheckpoint writes it: another file renamed
        assert best.written()
    with sk._checkpoint_callback(BestModelCheckpoint(), 0) as best:  # no path: a temporary
        assert best.path.endswith("best.keras") and best.callback.filepath == best.path
    gone = best.path
    assert not os.path.exists(os.path.dirname(gone))
    for other in (BestModelCheckpoint(filepath=str(old), save_freq=4),  # batch logs: no val_
                  BestModelCheckpoint(filepath=str(tmp_path / "e{epoch}.keras"))):
        with sk._checkpoint_callback(other, 0) as best:
            assert best.path is None and best.callback is other
    with sk._checkpoint_callback(mine, 1) as best:  # rank 0's only
        assert best is None


def test_fit_arguments_are_checked_by_name():
    from ringreduce.spark._estimator import _check_values

    good = {**TorchEstimator()._DEFAULTS, "feature_cols": ["v"], "label_cols": ["y"]}
    _check_values(good, "fit")
    for bad, match in (({"feature_cols": "v"}, "feature_cols must be a list"),
                       ({"batch_size": 0}, "batch_size=0"),
                       ({"validation_steps_per_epoch": 0}, "validation_steps_per_epoch=0"),
                       ({"epochs": -1}, "epochs=-1")):
        with pytest.raises(InvalidInputError, match=match):
            _check_values({**good, **bad}, "fit")
    # a default list is each estimator's own
    a, b = TorchEstimator(), TorchEstimator()
    a.getCallbacks().append("cb")
    assert b.getCallbacks() == [] and TorchEstimator().getMetrics() == []


def test_torch_optimizers_rebuild_and_losses_and_metrics_are_checked():
    torch = pytest.importorskip("torch")
    from ringreduce.spark import torch as st
    from ringreduce.spark._torch_remote import _rebuild_optimizer

    model = torch.nn.Linear(3, 2)
    for opt in (torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                torch.optim.SGD([{"params": [model.bias], "lr": 0.5},
                                 {"params": [model.weight]}], lr=0.1, momentum=0.9)):
        copy = torch.nn.Linear(3, 2)
        again = _rebuild_optimizer(st._optimizer_recipe(model, opt), copy)
        assert type(again) is type(opt) and again.param_groups[0]["params"][0] is (
            copy.bias if len(opt.param_groups) == 2 else copy.weight)
        assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in opt.param_groups]
    with pytest.raises(InvalidInputError, match="not the model's"):
        st._optimizer_recipe(model, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), 0.1))
    est = TorchEstimator(label_cols=["a", "b", "c"], loss=[len, len])
    with pytest.raises(InvalidInputError, match="2 losses for 3 label columns"):
        st._losses(est)

    def acc(o, y):
        return 0

    assert [n for n, _, _ in st._metric_specs(est.setMetrics([acc]))] == ["a_acc", "b_acc",
                                                                          "c_acc"]
    with pytest.raises(InvalidInputError, match=r"\['acc'\] repeat"):
        st._metric_specs(TorchEstimator(label_cols=["a"], metrics=[acc, acc]))


def test_torch_step_accumulates_and_labels_take_the_outputs_shape():
    torch = pytest.importorskip("torch")
    from ringreduce.spark._torch_remote import _Step, transform_outputs

    out, lab = transform_outputs(torch.zeros(4, 1), [torch.arange(4.0)])
    assert out[0].shape == lab[0].shape == (4, 1)  # not (4,) against (4, 1): no broadcast
    x, y = torch.randn(4, 3), torch.randn(4, 1)

    def loss_fn(outputs, labels, _w):
        return torch.nn.functional.mse_loss(outputs[0], labels[0])

    def stepped(k, batches):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = _Step(k)
        for rows in batches:
            step(model, opt, transform_outputs, loss_fn, [x[rows]], [y[rows]], None)
        step.finish(opt)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # two batches of 2 accumulated = one step on all 4 rows; a leftover batch steps too
    assert torch.allclose(stepped(2, [slice(0, 2), slice(2, 4)]), stepped(1, [slice(0, 4)]))
    assert torch.allclose(stepped(2, [slice(0, 4)]), stepped(1, [slice(0, 4)]))


def test_a_written_dataframe_is_reused_until_its_run_is_written_again(tmp_path):
    from ringreduce.spark._estimator import Materialized, _remember, _written

    class Frame:  # stands for a DataFrame: only its identity matters
        pass

    part = tmp_path / "part0.npz"
    part.write_bytes(b"x")
    token = str(tmp_path / "train.token")
    first, other, key = Frame(), Frame(), ("k",)
    written = Materialized([], [(str(part), 3)])
    _remember(first, key, token, written)
    assert _written(first, key, token) is written  # the same object, same key: reused
    assert _written(first, ("other key",), token) is None and _written(other, key, token) is None
    _remember(other, key, token, Materialized([], [(str(part), 3)]))  # the run's dir rewritten
    assert _written(first, key, token) is None  # its token is no longer the file's
    assert _written(other, key, token) is not None
    part.unlink()
    assert _written(other, key, token) is None  # its files are gone
