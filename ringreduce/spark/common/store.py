"""Where an estimator keeps a run's data, checkpoints and logs (Horovod's
``horovod.spark.common.store``).

The estimators write the training DataFrame into the store as one ``.npz`` file per Spark
partition, the ranks read their share from there, rank 0 writes a checkpoint after every
epoch, and a ``fit`` with the ``run_id`` of an earlier run resumes from its last one. So the
store's directory must be one that the driver and every executor see at the same path (a
local disk on a one-machine cluster, NFS or another shared mount on several)::

    store = Store.create("/shared/ringreduce")       # or LocalStore(...)
    est = TorchEstimator(store=store, run_id="mnist-1", ...)

Layout under ``prefix_path``: ``intermediate_train_data.<run>/part-00000.npz`` (and
``intermediate_val_data.<run>``), ``runs/<run>/checkpoint.pkl``, ``runs/<run>/logs``.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional
from urllib.parse import urlparse

from ...exceptions import InvalidInputError

__all__ = ["FilesystemStore", "LocalStore", "Store"]


class Store:
    """A run's files under one directory that every Spark executor can reach."""

    def __init__(self, prefix_path: str, train_path: Optional[str] = None,
                 val_path: Optional[str] = None, runs_path: Optional[str] = None) -> None:
        self.prefix_path = _local_path(prefix_path)
        self._train = train_path and _local_path(train_path)
        self._val = val_path and _local_path(val_path)
        self._runs = _local_path(runs_path) if runs_path else os.path.join(self.prefix_path,
                                                                            "runs")

    @staticmethod
    def create(prefix_path: str, *args, **kwargs) -> Store:
        """The store for ``prefix_path``: a local (or mounted) path or ``file://`` URL.

        Horovod's HDFS and DBFS stores need their own clients; mount the file system
        (DBFS is mounted at ``/dbfs`` on Databricks) and pass the mounted path instead.
        """
        return LocalStore(prefix_path, *args, **kwargs)

    def get_train_data_path(self, idx: Optional[str] = None) -> str:
        """The directory of the training data written for run ``idx``."""
        return self._train or os.path.join(self.prefix_path, f"intermediate_train_data.{idx}")

    def get_val_data_path(self, idx: Optional[str] = None) -> str:
        """The directory of the validation data written for run ``idx``."""
        return self._val or os.path.join(self.prefix_path, f"intermediate_val_data.{idx}")

    def get_runs_path(self) -> str:
        return self._runs

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self._runs, run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        """Rank 0's checkpoint of run ``run_id``, replaced atomically after every epoch."""
        return os.path.join(self.get_run_path(run_id), self.get_checkpoint_filename())

    def get_checkpoint_filename(self) -> str:
        return "checkpoint.pkl"

    def get_logs_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "logs")

    def exists(self, path: str) -> bool:
        return os.path.exists(_local_path(path))

    def is_parquet_dataset(self, path: str) -> bool:
        """Horovod's name; here: whether ``path`` holds data this store's estimators wrote."""
        return os.path.isdir(path) and any(n.endswith(".npz") for n in os.listdir(path))

    def remove(self, path: str) -> None:
        """Delete ``path`` (a file or a directory) if it exists."""
        path = _local_path(path)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """Horovod's hook to copy a rank's local files into the store: here the ranks
        write into the store directly, so it does nothing."""
        return lambda local_run_path: None


class LocalStore(Store):
    """A store on a file system mounted at the same path on the driver and executors."""


FilesystemStore = LocalStore


def _local_path(path: str) -> str:
    parsed = urlparse(str(path))
    if parsed.scheme in ("", "file"):
        return os.path.abspath(parsed.path if parsed.scheme else str(path))
    raise InvalidInputError(
        f"ringreduce.spark store: {path!r}: only local or mounted paths (or file:// URLs) are "
        "supported; mount the file system (HDFS through a FUSE or NFS gateway, DBFS at /dbfs) "
        "and give the mounted path")
