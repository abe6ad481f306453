"""``ringreduce.ray.train``: Ray Train's ``HorovodTrainer``, on ringreduce.

Ray Train 2.x (``RAY_TRAIN_V2_ENABLED``, the default since Ray 2.5x) refuses
``ray.train.horovod.HorovodTrainer``, and its old implementation needs Horovod built. This
module gives Ray Train a ringreduce backend and a trainer with ``HorovodTrainer``'s
arguments, so a Ray Train script keeps its ``ScalingConfig``, ``RunConfig``,
``FailureConfig``, datasets, ``ray.train.report`` and checkpoints::

    from ringreduce.ray.train import RingreduceTrainer   # or HorovodTrainer, HorovodConfig

    def train_loop(config):
        import ringreduce.torch as hvd
        hvd.init()
        ...                                  # a Horovod training loop
        ray.train.report({"loss": loss}, checkpoint=...)

    RingreduceTrainer(train_loop, train_loop_config={"lr": 0.1},
                      scaling_config=ScalingConfig(num_workers=4)).fit()

How a worker group becomes a world (``_RingreduceBackend``; ``_task_world`` states the
protocol shared with Spark and ``RayExecutor``):
  1. Ray Train starts the workers, orders them (its world ranks) and calls ``on_start``
     in its controller. Every worker describes itself: host identity, its node's IP
     address, a port free there.
  2. The controller gives worker ``i`` the env-var launch of rank ``i`` (Ray Train's world
     rank, so ``hvd.rank()`` equals ``ray.train.get_context().get_world_rank()``), with a
     new secret, and the settings the ``RingreduceConfig`` captured on the driver when it
     was made (the driver's ``RINGREDUCE_*`` / ``HOROVOD_*``, ``timeout_s``, ``nics``,
     ``env``). The user's ``init()`` in the training function joins that world.
  3. A worker whose training function raises leaves the world at once (the config's
     ``train_func_context``), and a dead one is gone with its process, so its peers'
     collectives raise ``PeerLostError`` naming it within a second and Ray Train sees
     the group fail. With ``FailureConfig(max_failures=k)`` Ray Train starts a new group
     (new processes) and ``on_start`` runs again: a new port and secret; the training
     function resumes from ``ray.train.get_checkpoint()``.
  4. ``on_shutdown`` makes every worker leave (``ringreduce.shutdown()``), waiting at
     most ``_LEAVE_TIMEOUT`` for a worker that does not answer (a frozen one).
Invariant: ranks come from Ray Train's one ordering of the group, and each group gets its
own secret, so a worker of a failed group can never join the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Union

try:
    import ray
    from ray.train.backend import Backend, BackendConfig
    from ray.train.v2._internal.constants import is_v2_enabled
except ImportError as _e:  # pragma: no cover - depends on the installation
    raise ImportError("ringreduce.ray.train needs Ray Train: pip install 'ringreduce[ray]' "
                      "(Ray >= 2.9 with its train extra)") from _e

if is_v2_enabled():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:  # Ray Train's first API (RAY_TRAIN_V2_ENABLED=0)
    from ray.train.data_parallel_trainer import DataParallelTrainer

from .. import _task_world as tw
from ..exceptions import InvalidInputError
from ._worker import join_world, leave_world, this_worker

__all__ = ["HorovodConfig", "HorovodTrainer", "RingreduceConfig", "RingreduceTrainer"]

logger = logging.getLogger(__name__)
# Seconds on_shutdown waits for the workers to leave the world: leaving takes
# milliseconds, or shutdown()'s 2 s grace when a collective waits for a frozen peer.
_LEAVE_TIMEOUT = 5.0


@dataclasses.dataclass
class RingreduceConfig(BackendConfig):
    """How Ray Train's workers form a ringreduce world (Horovod's ``HorovodConfig``).

    Parameters
    ----------
    timeout_s : float
        Seconds the ranks wait for each other when they form a world (as ``ringrun
        --start-timeout``; Horovod's default, 300).
    nics : str or collection of str, optional
        The network interface the ranks talk over (one, as ``ringrun
        --network-interfaces``).
    verbose : int
        2 or more prints each rank's host and address when a world forms.
    env : mapping, optional
        Variables for every worker, over the driver's ``RINGREDUCE_*`` and ``HOROVOD_*``
        variables, which are captured when the config is made (Ray Train runs the backend
        in its controller, not in the driver).
    key, ssh_port, ssh_identity_file, ssh_str, placement_group_timeout_s :
        Horovod's; accepted and ignored: Ray starts the workers (no ssh), and every world
        gets its own new secret.

    Raises
    ------
    InvalidInputError
        Several network interfaces.
    """

    timeout_s: float = 300
    nics: Union[None, str, frozenset, set, list, tuple] = None
    verbose: int = 1
    env: Optional[Mapping[str, Any]] = None
    key: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_str: Optional[str] = None
    placement_group_timeout_s: float = 100
    worker_env: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        nics = self.nics if self.nics is None or isinstance(self.nics, str) \
            else sorted(self.nics)
        try:
            self.worker_env = tw.driver_env(self.timeout_s, nics, self.env)
        except InvalidInputError as e:
            raise InvalidInputError(f"{type(self).__name__}: nics={self.nics!r}: {e}") from None

    @property
    def backend_cls(self) -> type:
        return _RingreduceBackend

    @property
    def train_func_context(self) -> Callable[[], Any]:
        return functools.partial(_training, self.worker_env)

    def to_dict(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "nics": self.nics, "verbose": self.verbose}


class _RingreduceBackend(Backend):
    """Steps 1, 2 and 4 of the module's protocol."""

    share_cuda_visible_devices: bool = True  # a host's ranks see each other's GPUs

    def on_start(self, worker_group: Any, backend_config: RingreduceConfig) -> None:
        workers = worker_group.execute(this_worker)
        order = list(range(len(workers)))
        secret = tw.new_secret()
        refs = [worker_group.execute_single_async(
                    i, join_world,
                    tw.world_env(workers, i, secret, backend_config.worker_env, order))
                for i in order]
        ray.get(refs)
        if backend_config.verbose >= 2:
            for i, w in enumerate(workers):
                print(f"ringreduce: rank {i} on host {w.host} at {w.address}", flush=True)

    def on_shutdown(self, worker_group: Any, backend_config: RingreduceConfig) -> None:
        """Every worker leaves; one that does not answer within ``_LEAVE_TIMEOUT`` (a
        frozen process) is left to Ray Train, which kills the group next."""
        try:
            ray.get(worker_group.execute_async(leave_world), timeout=_LEAVE_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            logger.warning("ringreduce: a Ray Train worker did not leave the world within "
                           "%g s (frozen?); Ray Train stops the group", _LEAVE_TIMEOUT)


@contextlib.contextmanager
def _training(settings: Mapping[str, str]) -> Iterator[None]:
    """Around the training function in each worker (step 3 of the module's protocol): a
    function that raises leaves the world at once, so its peers' collectives raise
    ``PeerLostError`` naming its rank instead of waiting for Ray Train to stop the group.
    In Ray Train's local mode (``num_workers=0``, no launch variables) the settings apply
    while it runs, and a world it started is left at its end."""
    import ringreduce as rr

    launched = "RINGREDUCE_SECRET" in os.environ
    saved = None if launched else tw.set_environ(settings)
    ours = launched or not rr.is_initialized()  # not a world the user's driver had open
    try:
        yield
    except BaseException:
        if ours:
            rr.shutdown()
        raise
    finally:
        if saved is not None:
            if ours:
                rr.shutdown()
            tw.restore_environ(saved)


class RingreduceTrainer(DataParallelTrainer):
    """Data-parallel training with ringreduce on Ray Train (``HorovodTrainer``'s arguments).

    Parameters
    ----------
    train_loop_per_worker : callable
        The training function, with no argument or one (``train_loop_config``). It calls
        ``init()`` of a ringreduce layer (``ringreduce.torch``, ``.tensorflow``,
        ``.keras``, ``.jax``, or ``ringreduce`` itself), as a Horovod function does; its
        rank is Ray Train's world rank.
    train_loop_config : dict, optional
        Passed to the training function.
    ringreduce_config : RingreduceConfig, optional
        Also accepted as ``horovod_config`` (Horovod's name), not both.
    scaling_config, run_config, datasets, dataset_config :
        Ray Train's, as for every ``DataParallelTrainer``.
    **kwargs :
        Further arguments of Ray Train's ``DataParallelTrainer``
        (``resume_from_checkpoint``, ``metadata`` on Ray Train's first API, ...).

    Raises
    ------
    InvalidInputError
        Both ``ringreduce_config`` and ``horovod_config``, or a config of another type.
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *,
                 train_loop_config: Optional[dict] = None,
                 ringreduce_config: Optional[RingreduceConfig] = None,
                 horovod_config: Optional[RingreduceConfig] = None,
                 scaling_config: Any = None, run_config: Any = None,
                 datasets: Optional[dict] = None, dataset_config: Any = None,
                 **kwargs: Any) -> None:
        name = type(self).__name__
        if ringreduce_config is not None and horovod_config is not None:
            raise InvalidInputError(f"{name}: give ringreduce_config or horovod_config, "
                                    "not both")
        config = ringreduce_config if ringreduce_config is not None else horovod_config
        if config is None:
            config = RingreduceConfig()
        if not isinstance(config, RingreduceConfig):
            raise InvalidInputError(
                f"{name}: the config must be a ringreduce.ray.train.RingreduceConfig (or "
                f"its alias HorovodConfig), got {type(config).__name__}; Ray's own "
                "HorovodConfig needs Horovod")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=config, scaling_config=scaling_config,
                         run_config=run_config, datasets=datasets,
                         dataset_config=dataset_config, **kwargs)


HorovodTrainer = RingreduceTrainer
HorovodConfig = RingreduceConfig
