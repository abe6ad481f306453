"""``ringreduce.ray``: Horovod's ``horovod.ray.RayExecutor`` on a Ray cluster.

A ``RayExecutor`` keeps one Ray actor per rank; ``run(fn)`` calls ``fn`` on all of them at
once and returns what each rank returned, in rank order::

    import ray
    from ringreduce.ray import RayExecutor

    def train(lr):
        import ringreduce.torch as hvd
        hvd.init()
        ...
        return model.state_dict()

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
    executor.start()
    states = executor.run(train, args=[0.1])
    executor.shutdown()

How the world forms and lives (``ringreduce/_task_world.py`` states the part shared with
Spark):
  1. ``start`` reserves a placement group (``_placement``) and starts one actor per worker.
  2. Every actor describes itself (host identity, its node's IP address, a free port, its
     GPUs); the driver computes the rank order from the list, a new secret and each rank's
     env-var launch (``RANK``, ``MASTER_ADDR``..., the driver's ``RINGREDUCE_*`` /
     ``HOROVOD_*`` settings, ``extra_env_vars``) and sends it; the actor keeps it in
     ``os.environ`` for good. Then each actor builds its ``executable_cls`` object.
  3. A call (``run``, ``execute``...) runs the user's function in every actor; the function
     calls ``init()``, which joins the world the first time and is harmless after, so
     ringreduce stays initialized between calls, as in Horovod.
  4. The driver waits on all the actors' answers at once (``ray.wait``) and raises as soon
     as one rank failed: at once for an actor that died (``_task_world.lost``) or for an
     error of the user's function; an error that only says a peer left
     (``PeerLostError``) waits a few seconds for the rank that caused it. A rank whose
     function raised has left the world already, so the others' collectives end within
     seconds instead of waiting.
  5. Before every call the driver asks each actor whether its last call succeeded (the
     answer comes after any call still in flight there). If one failed or died, the world
     is broken and formed anew: a dead actor is replaced by a new one in the same bundle
     (its executable built again), and step 2 runs again with a new port and secret, each
     actor leaving the old world first. The executor so stays usable after a failure.
  6. ``shutdown`` makes every actor leave (``ringreduce.shutdown()``), kills them and gives
     the placement group back.
Invariant: the actors' ranks always come from one list the driver computed, so no two
actors claim one rank, and a world's secret is never reused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

try:
    import ray
    import ray.exceptions
except ImportError as _e:  # pragma: no cover - depends on the installation
    raise ImportError("ringreduce.ray needs Ray: pip install 'ringreduce[ray]'") from _e

from .. import _task_world as tw
from ..exceptions import InvalidInputError, RingReduceError, RingReduceTimeoutError
from ._placement import Layout, Placement, visible_devices
from .elastic import ElasticRayExecutor, _first_line, make_settings, worker_resources

__all__ = ["ElasticRayExecutor", "RayExecutor", "RaySettings"]

_PEER_LOST_GRACE = 5.0  # seconds to wait for the root failure after a rank lost a peer
_LEAVE_TIMEOUT = 10.0   # seconds shutdown() waits for the actors to leave before killing them
_BROKEN_LEAVE_TIMEOUT = 1.0  # the same after a failed call


@dataclass
class RaySettings:
    """A ``RayExecutor``'s settings (Horovod's ``MiniSettings``); make it with
    ``RayExecutor.create_settings``."""

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: Union[None, str, Sequence[str]] = None
    ssh_identity_file: Optional[str] = None  # accepted, unused: no ssh under Ray


class RayExecutor:
    """Ranks in Ray actors that stay up between calls (Horovod's ``RayExecutor``).

    Parameters
    ----------
    settings : RaySettings, optional
        From ``RayExecutor.create_settings`` (default: its defaults).
    num_workers : int, optional
        Number of ranks, one actor each, placed where Ray has room (a ``PACK`` placement
        group). Give it or ``num_hosts``.
    num_hosts, num_workers_per_host : int, optional
        Instead of ``num_workers``: ``num_workers_per_host`` ranks (default 1) on each of
        ``num_hosts`` distinct nodes (a ``STRICT_SPREAD`` placement group of one bundle
        per node).
    cpus_per_worker : float
        CPUs each actor reserves (default 1).
    use_gpu : bool
        Whether each actor reserves GPUs (``gpus_per_worker``, default 1). A rank then sees
        all GPUs of its node's ranks in ``CUDA_VISIBLE_DEVICES``, in rank order, so with one
        GPU per worker its own is ``local_rank()``.
    gpus_per_worker : float, optional
        GPUs per actor; only with ``use_gpu``.
    use_current_placement_group : bool
        Inside a placement group already (a Ray Tune trial), start the actors in it
        (default); false makes a new one.
    min_workers, max_workers : int, optional
        Either set (instead of ``num_workers``) makes the executor elastic (Horovod's
        elastic ``RayExecutor``): ``run`` trains on every slot of the cluster's live nodes,
        between ``min_workers`` (default 1) and ``max_workers`` (default no limit) workers,
        as ``ElasticRayExecutor`` (``ringreduce/ray/elastic.py``) does; ``execute``,
        ``execute_single`` and ``run_remote`` are refused then.
    reset_limit, cooldown_range, elastic_timeout :
        The elastic job's (as ``ringrun --reset-limit``, ``--blacklist-cooldown-range``,
        ``--elastic-timeout``); the first two are refused in a fixed-size executor.
    override_discovery :
        Accepted and ignored (an elastic executor's hosts are Ray's live nodes).

    Raises
    ------
    InvalidInputError
        Neither or both of ``num_workers`` and ``num_hosts``, counts below 1, GPUs
        without ``use_gpu``, ``min_workers`` with ``num_workers``, an elastic argument in
        a fixed-size executor.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Union[None, str, Sequence[str]] = None) -> RaySettings:
        """Settings for a ``RayExecutor``.

        Parameters
        ----------
        timeout_s : float
            Seconds the ranks wait for each other when they form a world
            (``RINGREDUCE_CONNECT_TIMEOUT_SECONDS``, as ``ringrun --start-timeout``).
        ssh_identity_file, ssh_str :
            Accepted and ignored: Ray starts the workers, nothing runs over ssh (unlike
            Horovod, ``ssh_str`` is not written to ``ssh_identity_file``).
        placement_group_timeout_s : float
            Seconds ``start`` waits for Ray to reserve the workers' resources.
        nics : str or collection of str, optional
            The network interface the ranks talk over (one; as ``ringrun
            --network-interfaces``).

        Returns
        -------
        RaySettings
        """
        try:
            tw.driver_env(timeout_s, nics)  # refuses several interfaces now, not at start()
        except InvalidInputError as e:
            raise InvalidInputError(f"RayExecutor.create_settings: nics={nics!r}: {e}") from None
        return RaySettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                           nics=nics, ssh_identity_file=ssh_identity_file)

    def __init__(self, settings: Optional[RaySettings] = None, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None, use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[Sequence[int]] = None,
                 elastic_timeout: int = 1200, override_discovery: bool = True) -> None:
        cpus, gpus = worker_resources("RayExecutor", cpus_per_worker, use_gpu, gpus_per_worker)
        self.settings = settings if settings is not None else self.create_settings()
        self._placement: Optional[Placement] = None
        self._actors: list[Any] = []   # in the order they were made
        self._order: list[int] = []    # actor index of each rank
        self._env: dict[str, str] = {}
        self._executable: tuple = (None, (), {})
        self._broken = False           # a call failed: form the world anew before the next
        self._unbuilt: set[int] = set()  # actors whose executable object is still to make
        self._elastic: Optional[ElasticRayExecutor] = None
        if min_workers is not None or max_workers is not None:
            if num_workers is not None or num_hosts is not None:
                raise InvalidInputError("RayExecutor: give num_workers (or num_hosts) for a "
                                        "fixed-size job, or min_workers/max_workers for an "
                                        "elastic one, not both")
            elastic = make_settings(1 if min_workers is None else min_workers, max_workers,
                                    reset_limit, elastic_timeout, self.settings.timeout_s,
                                    self.settings.nics, cooldown_range, what="RayExecutor",
                                    names=("min_workers", "max_workers"))
            self._elastic = ElasticRayExecutor(elastic, use_gpu, cpus_per_worker, gpus_per_worker)
            return
        refused = [name for name, value in (("reset_limit", reset_limit),
                                            ("cooldown_range", cooldown_range))
                   if value is not None]
        if refused:
            raise InvalidInputError(f"RayExecutor: {', '.join(refused)} only mean something "
                                    "to an elastic executor (min_workers/max_workers)")
        _check_counts(num_workers, num_hosts, num_workers_per_host)
        self._layout = Layout(num_workers, num_hosts, num_workers_per_host, cpus, gpus,
                              use_current_placement_group)

    # ------------------------------------------------------------------ lifecycle
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[Mapping[str, Any]] = None,
              extra_env_vars: Optional[Mapping[str, Any]] = None) -> None:
        """Start the actors and form the world (the ranks join it at their ``init()``).

        Parameters
        ----------
        executable_cls : type, optional
            A class of which each actor makes one object, ``executable_cls(*executable_args,
            **executable_kwargs)``, after its launch variables are set; ``execute`` passes
            it to its function.
        executable_args, executable_kwargs : optional
            Its arguments.
        extra_env_vars : mapping, optional
            Variables set in every actor's environment, over the driver's ``RINGREDUCE_*``
            and ``HOROVOD_*`` variables and the settings' (values made ``str``).

        Raises
        ------
        InvalidInputError
            The executor is started already.
        RingReduceTimeoutError
            Ray did not reserve the resources within ``placement_group_timeout_s``.
        Exception
            The error of a rank whose ``executable_cls`` raised (the executor is then shut
            down again).
        """
        if self._elastic is not None:
            self._start_elastic(executable_cls, extra_env_vars)
            return
        if self._actors:
            raise InvalidInputError("RayExecutor.start: the executor is started already; "
                                    "call shutdown() before starting it again")
        self._env = tw.driver_env(self.settings.timeout_s, self.settings.nics, extra_env_vars)
        self._executable = (executable_cls, tuple(executable_args or ()),
                            dict(executable_kwargs or {}))
        timeout = self.settings.placement_group_timeout_s
        try:
            self._placement = Placement(self._layout, timeout)
            self._actors = [self._placement.actor(i) for i in range(self._layout.size)]
            self._order = list(range(len(self._actors)))  # until the world is formed
            self._unbuilt = set(self._order)
            self._form_world("RayExecutor.start", timeout)
            self._build("RayExecutor.start")
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Make every rank leave the job, kill the actors, release their resources.

        Harmless when not started. A rank still running a function is killed after 10 s
        (1 s after a failed call, whose survivors only wait for the ranks that left).
        """
        actors, self._actors, self._order = self._actors, [], []
        # A rank still busy in a broken world only waits for peers that left: little grace.
        grace, self._broken = (_BROKEN_LEAVE_TIMEOUT if self._broken else _LEAVE_TIMEOUT), False
        if actors:
            refs = [a.leave.remote() for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=grace)
            for actor in actors:
                ray.kill(actor)
        if self._placement is not None:
            self._placement.release()
            self._placement = None

    # ---------------------------------------------------------------------- calls
    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Mapping[str, Any]] = None,
            callbacks: Optional[Sequence[Callable[..., Any]]] = None) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return its values in rank order.

        Parameters
        ----------
        fn : callable
            Run in each actor; it calls ``init()`` itself (harmless when the actor is in
            the world already). ``fn``, its arguments and values travel by Ray's pickling.
        args, kwargs : optional
            Its arguments.
        callbacks : None
            Horovod's callbacks receive what rank 0 logs through ``horovod.ray``'s
            ``ray_logger``, which ringreduce does not have: anything but None is refused.

        Returns
        -------
        list
            ``fn``'s value on each rank, in rank order.

        Raises
        ------
        Exception
            The error of the rank that failed first (not counting ranks that only lost
            it), with that rank's traceback text as its ``__cause__``; RingReduceError
            naming the rank whose actor died. The executor stays usable.
        """
        _no_callbacks(callbacks, "RayExecutor.run")
        if self._elastic is not None:
            return self._elastic.elastic_run("RayExecutor.run", fn, tuple(args or ()),
                                             dict(kwargs or {}))
        return self._everywhere("RayExecutor.run", fn, tuple(args or ()), dict(kwargs or {}),
                                False)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[Sequence[Callable[..., Any]]] = None) -> list:
        """Call ``fn(executable)`` on every rank (the object ``start`` made from
        ``executable_cls``; None without one); return its values in rank order.

        ``callbacks`` and errors: as in ``run``.
        """
        _no_callbacks(callbacks, "RayExecutor.execute")
        self._not_elastic("RayExecutor.execute")
        return self._everywhere("RayExecutor.execute", fn, (), {}, True)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Call ``fn(executable)`` on rank 0 only and return its value (errors as in
        ``run``). ``fn`` must not wait for the other ranks: they run nothing."""
        what = "RayExecutor.execute_single"
        self._not_elastic(what)
        self._ready(what)
        return self._outcome([self._actors[self._order[0]].call.remote(fn, (), {}, True)],
                             what)[0]

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> list:
        """Start ``fn(*args, **kwargs)`` on every rank without waiting for it.

        Returns
        -------
        list of ray.ObjectRef
            One per rank, in rank order; ``ray.get`` gives ``fn``'s value, or raises the
            rank's error (Ray's ``RayTaskError`` for it, also an instance of its class) or
            ``RayActorError`` for a dead actor. The next call of the executor waits for
            these calls to end, and forms the world anew if one failed.
        """
        what = "RayExecutor.run_remote"
        self._not_elastic(what)
        self._ready(what)
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        return [self._actors[i].value.remote(fn, args, kwargs, what) for i in self._order]

    # ------------------------------------------------------------------ internals
    def _start_elastic(self, executable_cls: Optional[type],
                       extra_env_vars: Optional[Mapping[str, Any]]) -> None:
        assert self._elastic is not None
        if executable_cls is not None:
            raise InvalidInputError("RayExecutor.start: executable_cls is not supported in an "
                                    "elastic executor (its workers live for one run() call)")
        self._elastic.env_vars = dict(extra_env_vars or {})
        self._elastic.start()

    def _not_elastic(self, what: str) -> None:
        if self._elastic is not None:
            raise InvalidInputError(f"{what}: not supported by an elastic executor "
                                    "(min_workers/max_workers), as in Horovod; use run()")

    def _everywhere(self, what: str, fn: Callable[..., Any], args: tuple, kwargs: dict,
                    executable: bool) -> list:
        self._ready(what)
        return self._outcome([self._actors[i].call.remote(fn, args, kwargs, executable)
                              for i in self._order], what)

    def _ready(self, what: str) -> None:
        """Before a call: the executor is started, and its world whole (else formed anew,
        after any call still in flight in an actor ended)."""
        if not self._actors:
            raise InvalidInputError(f"{what}: the executor is not started; call start() "
                                    "first (or again, after shutdown())")
        healthy = self._probe()
        if self._broken or not all(healthy):
            self._renew(what, [i for i, ok in enumerate(healthy) if ok is None])

    def _probe(self) -> list[Optional[bool]]:
        """Each actor's last outcome (``Worker.healthy``), None for a dead actor."""
        refs = [a.healthy.remote() for a in self._actors]
        ray.wait(refs, num_returns=len(refs))
        out: list[Optional[bool]] = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def _renew(self, what: str, dead: Sequence[int]) -> None:
        """Form the world anew: new actors for the dead ones, new launch variables."""
        assert self._placement is not None
        for i in dead:
            ray.kill(self._actors[i])
            self._actors[i] = self._placement.actor(i)
            self._unbuilt.add(i)
        self._form_world(f"{what} (forming the world again after a failure)",
                         self.settings.placement_group_timeout_s)
        self._build(f"{what} (replacing dead workers)")
        self._broken = False

    def _form_world(self, what: str, timeout: Optional[float]) -> None:
        """Step 2 of the protocol: describe, rank order, launch variables sent."""
        found = self._control([a.describe.remote() for a in self._actors], what, timeout)
        workers = [w for w, _ in found]
        devices = visible_devices(workers, [g for _, g in found])
        secret = tw.new_secret()
        envs = [tw.world_env(workers, i, secret,
                             {**({"CUDA_VISIBLE_DEVICES": d} if d else {}), **self._env})
                for i, d in enumerate(devices)]
        self._order = tw.rank_order(workers)
        self._control([a.join.remote(env) for a, env in zip(self._actors, envs)], what, timeout)

    def _build(self, what: str) -> None:
        """Make the executable objects of the new actors (``_unbuilt``)."""
        ranks = sorted(self._order.index(i) for i in self._unbuilt)
        cls, args, kwargs = self._executable
        refs = [self._actors[self._order[r]].build.remote(cls, args, kwargs) for r in ranks]
        self._outcome(refs, what, ranks)
        self._unbuilt.clear()

    def _control(self, refs: Sequence[Any], what: str, timeout: Optional[float]) -> list:
        """The values of one call per actor (``refs`` in actor order), within ``timeout``."""
        ranks = [self._order.index(i) for i in range(len(refs))]
        got = dict(self._arrivals(dict(zip(refs, ranks)), what, lambda: None, timeout))
        if len(got) < len(refs):
            late = sorted(set(ranks) - set(got))
            raise RingReduceTimeoutError(f"{what}: rank(s) {late} did not answer within "
                                         f"{timeout:g} s")
        return [got[r] for r in ranks]

    def _outcome(self, refs: Sequence[Any], what: str,
                 ranks: Optional[Sequence[int]] = None) -> list:
        """The values of a call's records (``refs`` of ``ranks``, default 0, 1...), or the
        root failure raised as soon as it is known (step 4 of the protocol)."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        records: dict[int, Optional[dict]] = dict.fromkeys(ranks)
        deadline: list[Optional[float]] = [None]  # set once a rank lost its peer
        for rank, record in self._arrivals(dict(zip(refs, ranks)), what, lambda: deadline[0]):
            records[rank] = record
            if not record["ok"]:
                self._broken = True
                if not record.get("peer_lost"):
                    break
                deadline[0] = deadline[0] or time.monotonic() + _PEER_LOST_GRACE
        return tw.returned([records[r] for r in ranks], what)

    def _arrivals(self, pending: dict[Any, int], what: str,
                  deadline: Callable[[], Optional[float]],
                  timeout: Optional[float] = None) -> Iterator[tuple[int, Any]]:
        """``(rank, value)`` of each ref of ``pending`` (ref -> rank) as it ends, until all
        did, ``deadline()`` (a ``time.monotonic()`` value, re-read after each) passed or
        ``timeout`` seconds went by. A dead actor raises ``lost`` at once."""
        end = None if timeout is None else time.monotonic() + timeout
        while pending:
            limits = [t for t in (deadline(), end) if t is not None]
            left = max(0.0, min(limits) - time.monotonic()) if limits else None
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                return
            rank = pending.pop(done[0])
            yield rank, self._get(done[0], rank, what)

    def _get(self, ref: Any, rank: int, what: str) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._broken = True
            raise tw.lost(what, rank, _death(e)) from None
        except ray.exceptions.RayError as e:
            self._broken = True
            raise RingReduceError(f"{what}: rank {rank}: Ray failed the call: "
                                  f"{_first_line(e)}") from e


def _check_counts(num_workers: Optional[int], num_hosts: Optional[int],
                  num_workers_per_host: int) -> None:
    if num_workers is not None and num_hosts is not None:
        raise InvalidInputError("RayExecutor: give num_workers or num_hosts (with "
                                "num_workers_per_host), not both")
    if num_workers is None and num_hosts is None:
        raise InvalidInputError("RayExecutor: say how many ranks: num_workers=N, or "
                                "num_hosts=H (with num_workers_per_host=K) for K ranks on "
                                "each of H nodes")
    for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                        ("num_workers_per_host", num_workers_per_host)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidInputError(f"RayExecutor: {name}={value!r}: need a whole number >= 1")


def _no_callbacks(callbacks: Optional[Sequence[Any]], what: str) -> None:
    if callbacks is not None:
        raise InvalidInputError(f"{what}: callbacks are not supported (Horovod calls them "
                                "with what rank 0 logs through horovod.ray's ray_logger, "
                                "which ringreduce has no counterpart of); return the values "
                                "from the function instead, or pass callbacks=None")


def _death(e: BaseException) -> str:
    """What Ray says of a dead actor, shortened: its first line, pid and node."""
    lines = [line.strip() for line in str(e).splitlines()]
    where = [line for line in lines if line.startswith(("pid:", "ip:"))]
    return _first_line(e) + (f" ({', '.join(where)})" if where else "")
