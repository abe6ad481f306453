"""What Horovod's Spark ML estimators share, written once for ``ringreduce.spark.torch``,
``ringreduce.spark.lightning`` and ``ringreduce.spark.keras`` (Horovod's
``horovod.spark.common``).

A ``fit(df)`` runs in four steps; the framework layers supply only the training function
that runs on every rank and the prediction of one batch:

1. **Materialize** (driver): the feature, label, sample-weight columns are checked against
   the DataFrame's schema, split into training and validation rows (a fraction, by Spark's
   ``randomSplit`` with the estimator's seed, or a boolean or numeric column whose nulls
   mean training), repartitioned into ``num_proc * partitions_per_process`` partitions,
   and every partition is written by its Spark task as one ``.npz`` file into the store (a
   column per array; ML vectors and array columns as 2-D arrays). The tasks report their
   row counts, nulls and vector lengths, which the driver checks across all parts. A
   DataFrame this driver already wrote for the run is not written again (``_WRITTEN``).
2. **Assign** (driver): partitions go to ranks largest first, each to the rank with the
   fewest rows so far, so the ranks' shares differ by at most one partition. A rank with no
   rows is refused before training starts.
3. **Train** (``ringreduce.spark.run``, one barrier stage of ``num_proc`` tasks): every rank
   loads its share and takes exactly ``steps_per_epoch`` batches per epoch (Horovod's
   ``train_rows // (batch_size * num_proc)`` unless set), wrapping around its rows as
   Petastorm's endless reader does, so every rank makes the same number of collective
   steps whatever its share. Validation runs over each rank's whole share and is summed
   across ranks, so its loss is the exact mean over the validation rows. Rank 0 replaces the
   run's checkpoint atomically after every epoch; a ``fit`` with the ``run_id`` of a run
   that has a checkpoint resumes after its last epoch, with its history.
4. **Model** (driver): rank 0's trained weights and history come back in a Spark ML
   ``Model`` whose ``transform(df)`` appends one prediction column per label column
   (``<label>__output``: a double for one value per row, a dense vector otherwise),
   predicting each partition in its own task.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
from pyspark.ml import Estimator as _SparkEstimator
from pyspark.ml import Model as _SparkModel
from pyspark.ml.param import Param, Params
from pyspark.ml.util import MLReadable, MLWritable

from ..checkpoint import atomic_write
from ..exceptions import InvalidInputError
from .common.store import Store

# Horovod's parameter names and defaults (horovod/spark/common/params.py), shared by both
# estimators; a framework adds its own.
COMMON_PARAMS: dict[str, Any] = {
    "num_proc": None, "model": None, "optimizer": None, "loss": None, "loss_weights": None,
    "metrics": [], "store": None, "backend": None, "feature_cols": None, "label_cols": None,
    "sample_weight_col": None, "validation": None, "callbacks": [], "batch_size": 32,
    "val_batch_size": None, "epochs": 1, "train_steps_per_epoch": None,
    "validation_steps_per_epoch": None, "random_seed": None, "shuffle": True,
    "shuffle_buffer_size": None, "verbose": 1, "partitions_per_process": 10, "run_id": None,
    "gradient_compression": None, "label_shapes": None, "transformation_fn": None,
    "transformation_edit_fields": None, "transformation_removed_fields": None,
    "use_gpu": True, "inmemory_cache_all": False, "compress_sparse_cols": False,
    "train_reader_num_workers": 2, "val_reader_num_workers": 2, "reader_pool_type": "thread",
}

_SCALARS = {"DoubleType": np.float64, "FloatType": np.float32, "LongType": np.int64,
            "IntegerType": np.int64, "ShortType": np.int64, "ByteType": np.int64,
            "BooleanType": np.bool_}


def camel(name: str) -> str:
    return "".join(w.capitalize() for w in name.split("_"))


def with_params(names: Mapping[str, Any]) -> Callable[[type], type]:
    """A class decorator: a Spark ML ``Param`` and Horovod's ``getX``/``setX`` per name."""
    def decorate(cls: type) -> type:
        cls._DEFAULTS = {**getattr(cls, "_DEFAULTS", {}), **names}
        for name in names:
            setattr(cls, name, Param(Params._dummy(), name, name.replace("_", " ")))
            setattr(cls, "get" + camel(name), lambda self, n=name: self.getOrDefault(n))
            setattr(cls, "set" + camel(name), lambda self, v, n=name: self._set(**{n: v}))
        return cls
    return decorate


class _ParamsMixin:
    """Keyword arguments become params; an unknown keyword is refused by name."""

    _DEFAULTS: dict[str, Any] = {}
    _WHAT = "estimator"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._init_params(kwargs)

    def _init_params(self, kwargs: Mapping[str, Any]) -> None:
        unknown = sorted(set(kwargs) - set(self._DEFAULTS))
        if unknown:
            raise InvalidInputError(f"{self._WHAT}: unknown argument(s) {', '.join(unknown)}")
        # a copy per instance: appending to one estimator's callbacks must not change others'
        self._setDefault(**{k: copy.copy(v) for k, v in self._DEFAULTS.items()})
        self._set(**{k: v for k, v in kwargs.items() if v is not None})

    def setParams(self, **kwargs: Any) -> Any:
        self._init_params(kwargs)
        return self


# ------------------------------------------------------------------ 1. materialize
@dataclass
class Column:
    """How one DataFrame column becomes an array: its numpy dtype, and whether each row
    holds a vector (an ML vector or an array column) rather than a scalar."""
    name: str
    dtype: str
    vector: bool


def describe_columns(schema: Any, names: Sequence[str], what: str) -> list[Column]:
    """The columns ``names`` of a Spark ``schema``; refuses missing or unusable ones."""
    fields = {f.name: f for f in schema.fields}
    out = []
    for name in names:
        if name not in fields:
            raise InvalidInputError(f"{what}: column {name!r} is not in the DataFrame "
                                    f"(columns: {', '.join(fields)})")
        t = fields[name].dataType
        kind = type(t).__name__
        if kind in _SCALARS:
            out.append(Column(name, np.dtype(_SCALARS[kind]).name, False))
        elif kind == "VectorUDT":
            out.append(Column(name, "float64", True))
        elif kind == "ArrayType" and type(t.elementType).__name__ in _SCALARS:
            out.append(Column(name, np.dtype(_SCALARS[type(t.elementType).__name__]).name, True))
        else:
            raise InvalidInputError(f"{what}: column {name!r} has type {t.simpleString()}: "
                                    "numbers, ML vectors and arrays of numbers are supported")
    return out


def rows_to_arrays(rows: Sequence[Any], columns: Sequence[Column]) -> dict[str, np.ndarray]:
    """Spark rows as one array per column (vectors stacked into 2-D arrays)."""
    out = {}
    for i, col in enumerate(columns):
        values = [r[i] for r in rows]
        if any(v is None for v in values):
            raise InvalidInputError(f"column {col.name!r} holds nulls: fill or drop them "
                                    "(df.na.drop / df.na.fill) first")
        if col.vector:
            values = [v.toArray() if hasattr(v, "toArray") else v for v in values]
            lengths = {len(v) for v in values}
            if len(lengths) > 1:
                raise InvalidInputError(f"column {col.name!r}: rows hold vectors of different "
                                        f"lengths {sorted(lengths)[:4]}")
            out[col.name] = np.asarray(values, dtype=col.dtype).reshape(len(values), -1)
        else:
            out[col.name] = np.asarray(values, dtype=col.dtype)
    return out


def _write_partition(directory: str, columns: list[Column], index: int,
                     rows: Iterator[Any]) -> Iterator[dict]:
    """One Spark task's part: its rows into ``part-<index>.npz`` (atomically). What the
    driver must check across parts comes back instead of raising here (an exception in a
    task reaches the driver as Spark's, and one part sees only its own rows): each
    column's nulls and vector lengths; a part with nulls is not written."""
    rows = list(rows)
    if not rows:
        return
    nulls = {c.name: sum(r[i] is None for r in rows) for i, c in enumerate(columns)}
    widths = {c.name: sorted({len(r[i]) for r in rows if r[i] is not None})
              for i, c in enumerate(columns) if c.vector}
    path = None
    if not any(nulls.values()) and all(len(w) == 1 for w in widths.values()):
        arrays = rows_to_arrays(rows, columns)
        path = os.path.join(directory, f"part-{index:05d}.npz")
        atomic_write(path, lambda f: np.savez(f, **arrays))
    yield {"path": path, "rows": len(rows), "nulls": nulls, "widths": widths}


@dataclass
class Materialized:
    """A run's data in the store: ``(path, rows)`` per part, and the columns."""
    columns: list[Column]
    train: list[tuple[str, int]]
    val: list[tuple[str, int]] = field(default_factory=list)
    token: str = ""  # the content of the token file written with these parts

    @property
    def train_rows(self) -> int:
        return sum(n for _, n in self.train)

    @property
    def val_rows(self) -> int:
        return sum(n for _, n in self.val)


# Horovod's rule: a DataFrame already written for a run (the same object, with the same
# columns, validation, partition count and seed) is not written again while this driver
# runs, so a resumed fit trains on the same shares; a token file beside the data tells
# whether another fit has written that run's directory since.
_WRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _written(df: Any, key: tuple, token_path: str) -> Optional[Materialized]:
    try:
        out = _WRITTEN.get(df, {}).get(key)
    except TypeError:  # a DataFrame kind that takes no weak references: write it again
        return None
    if out is None or not os.path.exists(token_path):
        return None
    with open(token_path) as f:
        if f.read() != out.token:
            return None
    paths = [p for p, _ in out.train + out.val]
    return out if all(os.path.exists(p) for p in paths) else None


def _remember(df: Any, key: tuple, token_path: str, out: Materialized) -> None:
    out.token = uuid.uuid4().hex
    atomic_write(token_path, lambda f: f.write(out.token.encode()))
    try:
        _WRITTEN.setdefault(df, {})[key] = out
    except TypeError:
        pass


def materialize(df: Any, store: Store, run_id: str, columns: list[Column], validation: Any,
                parts: int, seed: Optional[int], what: str) -> Materialized:
    """Write the training (and validation) rows of ``df`` into the store (unless this
    driver wrote them for this run already)."""
    names = [c.name for c in columns]
    token_path = store.get_train_data_path(run_id).rstrip("/") + ".token"
    key = (token_path, tuple(names), repr(validation), parts, seed)
    done = _written(df, key, token_path)
    if done is not None:
        return done
    if os.path.exists(token_path):
        os.remove(token_path)  # the directory is about to change
    if validation is None:
        train_df, val_df = df.select(*names), None
    elif isinstance(validation, str):
        if describe_columns(df.schema, [validation], what)[0].vector:
            raise InvalidInputError(f"{what}: the validation column {validation!r} must hold "
                                    "booleans or numbers, one per row")
        from pyspark.sql import functions as F

        flag = F.coalesce(df[validation].cast("boolean"), F.lit(False))  # null: training
        train_df = df.filter(~flag).select(*names)
        val_df = df.filter(flag).select(*names)
    elif isinstance(validation, float) and 0 < validation < 1:
        train_df, val_df = df.select(*names).randomSplit([1 - validation, validation],
                                                         seed=seed)
    else:
        raise InvalidInputError(f"{what}: validation={validation!r}: give a fraction in "
                                "(0, 1) or the name of a boolean or numeric column")
    out = Materialized(columns, _write(train_df, store.get_train_data_path(run_id), columns,
                                       parts, what))
    if val_df is not None:
        out.val = _write(val_df, store.get_val_data_path(run_id), columns, parts, what)
        if not out.val_rows:
            raise InvalidInputError(f"{what}: validation={validation!r} left no validation rows")
    if not out.train_rows:
        raise InvalidInputError(f"{what}: the DataFrame has no training rows")
    _remember(df, key, token_path, out)
    return out


def _write(df: Any, directory: str, columns: list[Column], parts: int,
           what: str) -> list[tuple[str, int]]:
    """``df`` into ``parts`` files under ``directory``; ``(path, rows)`` of each. Refuses
    nulls and vectors of different lengths by column, over every part."""
    shutil.rmtree(directory, ignore_errors=True)  # a previous fit of this run's partitions
    os.makedirs(directory)
    writer = _PartitionWriter(directory, columns)
    reports = df.repartition(parts).rdd.mapPartitionsWithIndex(writer).collect()
    for col in columns:
        nulls = sum(r["nulls"][col.name] for r in reports)
        if nulls:
            raise InvalidInputError(f"{what}: column {col.name!r} holds {nulls} null(s): fill "
                                    "or drop them (df.na.fill / df.na.drop) before fit")
        widths = sorted({w for r in reports for w in r["widths"].get(col.name, [])})
        if len(widths) > 1:
            raise InvalidInputError(f"{what}: column {col.name!r} holds vectors of different "
                                    f"lengths ({', '.join(map(str, widths[:5]))})")
    return sorted((r["path"], r["rows"]) for r in reports)


class _PartitionWriter:
    def __init__(self, directory: str, columns: list[Column]) -> None:
        self.directory, self.columns = directory, columns

    def __call__(self, index: int, rows: Iterator[Any]) -> Iterator[dict]:
        return _write_partition(self.directory, self.columns, index, rows)


# ------------------------------------------------------------------ 2. assign
def assign(parts: Sequence[tuple[str, int]], num_proc: int, what: str) -> list[list[str]]:
    """Each rank's part files: largest first, each to the rank with the fewest rows. A
    rank without rows is refused (for validation too: its metrics' names come from the
    batches it evaluates, and every rank must sum the same ones)."""
    shares: list[list[str]] = [[] for _ in range(num_proc)]
    rows = [0] * num_proc
    for path, n in sorted(parts, key=lambda p: -p[1]):
        r = rows.index(min(rows))
        shares[r].append(path)
        rows[r] += n
    empty = [r for r in range(num_proc) if not rows[r]]
    if empty:
        raise InvalidInputError(
            f"{what}: rank(s) {empty} would get no rows: {sum(rows)} rows in {len(parts)} "
            f"non-empty partitions for num_proc={num_proc}; give more rows or fewer ranks")
    return shares


# ------------------------------------------------------------------ 3. train (on a rank)
class RankData:
    """One rank's rows, loaded from its part files."""

    def __init__(self, paths: Sequence[str]) -> None:
        loaded = [np.load(p) for p in paths]
        names = loaded[0].files if loaded else []
        self.arrays = {n: np.concatenate([d[n] for d in loaded]) for n in names}
        self.rows = len(next(iter(self.arrays.values()))) if self.arrays else 0

    def batches(self, epoch: int, steps: int, batch_size: int, shuffle: bool,
                seed: int) -> Iterator[dict[str, np.ndarray]]:
        """``steps`` batches of ``batch_size`` rows, wrapping around this rank's rows; in
        an order of this epoch and rank when ``shuffle``."""
        need = steps * batch_size
        if shuffle:
            rng = np.random.default_rng([seed, epoch])
            order = np.concatenate([rng.permutation(self.rows)
                                    for _ in range(-(-need // self.rows))])
        else:
            order = np.resize(np.arange(self.rows), need)
        for s in range(steps):
            idx = order[s * batch_size:(s + 1) * batch_size]
            yield {n: a[idx] for n, a in self.arrays.items()}

    def in_order(self, batch_size: int, limit: Optional[int] = None
                 ) -> Iterator[dict[str, np.ndarray]]:
        """Every row once (or the first ``limit`` batches), in batches."""
        for b, start in enumerate(range(0, self.rows, batch_size)):
            if limit is not None and b >= limit:
                return
            yield {n: a[start:start + batch_size] for n, a in self.arrays.items()}


@dataclass
class TrainSpec:
    """Everything a rank needs, sent to the tasks by Spark's pickling."""
    payload: Any               # the framework's model/optimizer/loss, as it serialized them
    params: dict[str, Any]     # the estimator's param values
    train: list[list[str]]     # part files per rank
    val: list[list[str]]
    train_rows: int
    val_rows: int
    checkpoint: str
    run_id: str

    def steps_per_epoch(self, size: int) -> int:
        """Horovod's rule: the set value, else ``train_rows // (batch_size * size)``, at
        least one."""
        set_steps = self.params["train_steps_per_epoch"]
        return int(set_steps or max(1, self.train_rows // (self.params["batch_size"] * size)))

    def val_batch_size(self) -> int:
        return int(self.params["val_batch_size"] or self.params["batch_size"])

    def seed(self) -> int:
        s = self.params["random_seed"]
        return 0 if s is None else int(s)


def load_resume(comm: Any, spec: TrainSpec) -> Optional[dict]:
    """The run's last checkpoint on every rank (read on rank 0), or None."""
    from ..checkpoint import load_on_root, read_pickled_dict

    return load_on_root(comm, spec.checkpoint, 0, read_pickled_dict, missing_ok=True)


def mismatched_checkpoint(what: str, spec: TrainSpec, err: BaseException,
                          of: str = "model") -> InvalidInputError:
    """The error for a run whose checkpoint does not fit ``of`` (raised on every rank)."""
    return InvalidInputError(
        f"{what}.fit: run_id {spec.run_id!r} has a checkpoint at {spec.checkpoint!r} from a "
        f"different {of} ({err}); give a new run_id or remove that run's directory")


def end_epoch(comm: Any, spec: TrainSpec, epoch: int, row: Mapping[str, float],
              history: dict, state: dict) -> None:
    """An epoch's values into ``history`` (printed by rank 0 with ``verbose``), then rank 0
    replaces the run's checkpoint: ``state`` (the framework's weights and optimizer) with
    the history."""
    from ..checkpoint import save_on_root

    for k, v in row.items():
        history.setdefault(k, []).append(v)
    if comm.rank() != 0:
        return
    if spec.params["verbose"]:
        print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.6g}" for k, v in row.items()),
              flush=True)
    os.makedirs(os.path.dirname(spec.checkpoint), exist_ok=True)
    save_on_root(comm, spec.checkpoint, 0,
                 lambda f: pickle.dump({**state, "history": history}, f, protocol=4))


def mean_across(comm: Any, sums: Mapping[str, float], count: float) -> dict[str, float]:
    """``sums[k] / count`` over every rank's sums and counts (one allreduce)."""
    import ringreduce as rr

    keys = sorted(sums)
    total = comm.allreduce(np.array([*(sums[k] for k in keys), count], np.float64),
                           op=rr.Sum, name="estimator.metrics")
    return {k: float(total[i] / total[-1]) for i, k in enumerate(keys)}


# ------------------------------------------------------------------ driver side
_AT_LEAST_ONE = ("batch_size", "val_batch_size", "train_steps_per_epoch",
                 "validation_steps_per_epoch", "backward_passes_per_step",
                 "partitions_per_process", "num_proc")


def _check_values(p: Mapping[str, Any], what: str) -> None:
    """Refuse by name the values that would fail later, on the ranks."""
    for name in ("feature_cols", "label_cols"):
        if isinstance(p[name], str) or not all(isinstance(c, str) for c in p[name]):
            raise InvalidInputError(f"{what}: {name} must be a list of column names, got "
                                    f"{p[name]!r}")
    for name in _AT_LEAST_ONE:
        v = p.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InvalidInputError(f"{what}: {name}={v!r}: give a whole number >= 1")
    if not isinstance(p["epochs"], int) or isinstance(p["epochs"], bool) or p["epochs"] < 0:
        raise InvalidInputError(f"{what}: epochs={p['epochs']!r}: give a whole number >= 0")


class EstimatorBase(_ParamsMixin, _SparkEstimator):
    """``fit(df)``: materialize, assign, train on ``num_proc`` ranks, wrap the result.

    A framework subclass sets ``_WHAT`` and implements ``_payload()`` (what the ranks
    need, picklable), ``_remote()`` (the function each rank runs: ``fn(spec)`` returning
    ``{"weights": ..., "history": ...}`` on rank 0) and ``_make_model(weights, history,
    run_id)``.
    """

    _REQUIRED = ("model", "optimizer", "feature_cols", "label_cols", "store")

    def _fit(self, df: Any) -> Any:
        from . import run

        what = f"{self._WHAT}.fit"
        spec = self._spec(df, what)
        num_proc = len(spec.train)
        results = run(self._remote(), args=(spec,), num_proc=num_proc,
                      verbose=self.getOrDefault("verbose"))
        return self._make_model(results[0]["weights"], results[0]["history"], spec.run_id)

    def _spec(self, df: Any, what: str) -> TrainSpec:
        p = {name: self.getOrDefault(name) for name in self._DEFAULTS}
        petastorm = [n for n in self._DEFAULTS if n.startswith("transformation_") and p[n]]
        if petastorm:
            raise InvalidInputError(
                f"{what}: {', '.join(petastorm)}: not supported (Horovod applies them as a "
                "Petastorm TransformSpec to pandas batches; there is no Petastorm here): "
                "transform the DataFrame with Spark before fit")
        for name in self._REQUIRED:
            if not p[name]:
                raise InvalidInputError(f"{what}: {name} is required")
        _check_values(p, what)
        if p["sample_weight_col"] and p["sample_weight_col"] in p["feature_cols"]:
            raise InvalidInputError(f"{what}: the sample weights cannot be a feature column")
        payload = self._payload()  # refuses a bad model before any data is written
        store = p["store"]
        run_id = p["run_id"] or f"ringreduce_{uuid.uuid4().hex[:12]}"
        num_proc = p["num_proc"] or df.sparkSession.sparkContext.defaultParallelism
        names = [*p["feature_cols"], *p["label_cols"]] + (
            [p["sample_weight_col"]] if p["sample_weight_col"] else [])
        columns = describe_columns(df.schema, names, what)
        data = materialize(df, store, run_id, columns, p["validation"],
                           num_proc * max(1, int(p["partitions_per_process"])),
                           p["random_seed"], what)
        return TrainSpec(payload, p, assign(data.train, num_proc, what),
                         assign(data.val, num_proc, f"{what} (validation rows)")
                         if data.val else [[]] * num_proc,
                         data.train_rows, data.val_rows, store.get_checkpoint_path(run_id),
                         run_id)

    def _payload(self) -> Any:
        raise NotImplementedError

    def _remote(self) -> Callable[[TrainSpec], Any]:
        raise NotImplementedError

    def _make_model(self, weights: Any, history: dict, run_id: str) -> Any:
        raise NotImplementedError


@with_params({"model": None, "feature_columns": None, "label_columns": None,
              "output_cols": None, "history": None, "run_id": None})
class ModelBase(_ParamsMixin, _SparkModel, MLWritable, MLReadable):
    """A trained model as a Spark ML ``Model``: ``transform(df)`` appends one prediction
    column per label column; ``write().save(path)`` and ``load(path)`` (``_persist.py``).
    A framework subclass implements ``_predictor()``: a picklable ``fn(list of feature
    arrays) -> list of output arrays`` (one per label column), and ``_model_to_bytes`` /
    ``_model_from_bytes``."""

    def getHistory(self) -> dict:
        return self.getOrDefault("history")

    def write(self) -> Any:
        from ._persist import ModelWriter

        return ModelWriter(self)

    @classmethod
    def read(cls) -> Any:
        from ._persist import ModelReader

        return ModelReader(cls)

    def _model_to_bytes(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def _model_from_bytes(cls, data: bytes, params: dict) -> Any:
        raise NotImplementedError

    def _output_names(self) -> list[str]:
        return self.getOrDefault("output_cols") or [
            f"{c}__output" for c in self.getOrDefault("label_columns")]

    def _predictor(self) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
        raise NotImplementedError

    def _transform(self, df: Any) -> Any:
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql.types import DoubleType, StructField, StructType

        what = f"{self._WHAT}.transform"
        features = describe_columns(df.schema, self.getOrDefault("feature_columns"), what)
        predict = self._predictor()
        first = df.limit(1).collect()
        widths = [1] * len(self._output_names())
        idx = [df.columns.index(c.name) for c in features]
        if first:  # a vector or a double per row: ask the model about one row
            arrays = rows_to_arrays([[first[0][i] for i in idx]], features)
            widths = [int(np.asarray(o).size) for o in predict([arrays[c.name]
                                                               for c in features])]
        outs = self._output_names()
        schema = StructType(df.schema.fields + [
            StructField(o, DoubleType() if w == 1 else VectorUDT(), True)
            for o, w in zip(outs, widths)])
        fn = _Predict(predict, features, idx, widths)
        return df.sparkSession.createDataFrame(df.rdd.mapPartitions(fn), schema)


class _Predict:
    """One partition's rows with the predictions appended, 256 rows per model call."""

    def __init__(self, predict: Callable, features: list[Column], idx: list[int],
                 widths: list[int]) -> None:
        self.predict, self.features, self.idx, self.widths = predict, features, idx, widths

    def __call__(self, rows: Iterator[Any]) -> Iterator[tuple]:
        from pyspark.ml.linalg import DenseVector

        rows = list(rows)
        for start in range(0, len(rows), 256):
            chunk = rows[start:start + 256]
            arrays = rows_to_arrays([[r[i] for i in self.idx] for r in chunk], self.features)
            outs = [np.asarray(o, np.float64).reshape(len(chunk), -1)
                    for o in self.predict([arrays[c.name] for c in self.features])]
            for j, row in enumerate(chunk):
                extra = [float(o[j, 0]) if w == 1 else DenseVector(o[j])
                         for o, w in zip(outs, self.widths)]
                yield (*row, *extra)
