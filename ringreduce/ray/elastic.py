"""Elastic training on Ray: Horovod's ``ElasticRayExecutor``, and ``RayExecutor`` with
``min_workers`` / ``max_workers``.

It is ``ringrun``'s elastic mode (``ringreduce/elastic/driver.py`` states the generation
protocol) with Ray in two places:

* **Hosts** are Ray's live nodes (``RayHosts``), polled every second: a node's slots are
  its CPUs over ``cpus_per_slot`` (and its GPUs over ``gpus_per_slot`` with ``use_gpu``).
  A node that joins the cluster is a host added (the job grows toward ``max_num_proc`` at
  the members' next commit); a node that leaves is a host removed. A host is named
  ``<node IP>/<first 8 hex digits of its node id>``, since several nodes may share an IP.
  Horovod's own discovery object (``settings.discovery`` with ``override_discovery=False``)
  may name hosts by IP address instead.
* **Workers** are Ray actors (``RaySpawner``), one per slot, pinned to their node (hard
  node affinity), each running the user's function once with the driver's variables
  in its environment; the function calls ``init()`` and wraps its loop in
  ``hvd.elastic.run``, as under ``ringrun``. The driver's handle on an actor
  (``ActorProcess``) reads the call's outcome as an exit code: 0 for a value (or a
  worker told to leave), 1 for an error, -9 (killed) for an actor that died, whose
  reason is logged.

The driver runs in the caller's process and listens on a port of its own; the actors
reach it at the driver node's IP address. ``run`` returns the values of the last
generation's ranks, in rank order, or raises that generation's error, or the driver's
reason for ending the job.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import _task_world as tw
from ..elastic.discovery import Discovery
from ..elastic.driver import ElasticDriver, ElasticSettings, drive
from ..elastic.hosts import check_cooldown_range
from ..exceptions import InvalidInputError
from ..launcher import HostSlots, _say
from ._placement import _remote_worker

__all__ = ["ElasticRayExecutor", "ElasticRaySettings", "RayHosts"]


@dataclass
class ElasticRaySettings:
    """An elastic job's settings (Horovod's ``ElasticSettings``); make it with
    ``ElasticRayExecutor.create_settings``."""

    min_num_proc: int = 1
    max_num_proc: Optional[int] = None   # None: as many as the cluster has slots
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    nics: Union[None, str, Sequence[str]] = None
    cooldown_range: Optional[tuple[float, float]] = None
    discovery: Any = None                # Horovod's HostDiscovery, or None: RayHosts
    ssh_identity_file: Optional[str] = None  # accepted, unused: no ssh under Ray
    verbose: int = 0


def make_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                  reset_limit: Optional[int] = None, elastic_timeout: float = 600,
                  timeout_s: float = 30, nics: Union[None, str, Sequence[str]] = None,
                  cooldown_range: Optional[Sequence[float]] = None,
                  what: str = "ElasticRayExecutor.create_settings",
                  names: tuple[str, str] = ("min_num_proc", "max_num_proc"), **rest: Any
                  ) -> ElasticRaySettings:
    """Checked settings (the work of ``ElasticRayExecutor.create_settings``; ``what`` and
    ``names`` are the caller's and its arguments' names, for errors)."""
    low, high = names
    if not isinstance(min_num_proc, int) or min_num_proc < 1:
        raise InvalidInputError(f"{what}: {low}={min_num_proc!r}: need a whole number >= 1")
    if max_num_proc is not None and (not isinstance(max_num_proc, int)
                                     or max_num_proc < min_num_proc):
        raise InvalidInputError(f"{what}: {high}={max_num_proc!r}: need a whole number "
                                f">= {low} ({min_num_proc}), or None for no limit")
    if elastic_timeout is None or elastic_timeout <= 0:
        raise InvalidInputError(f"{what}: elastic_timeout={elastic_timeout!r}: need seconds > 0")
    try:
        tw.driver_env(timeout_s, nics)  # refuses several interfaces now, not at run()
    except InvalidInputError as e:
        raise InvalidInputError(f"{what}: nics={nics!r}: {e}") from None
    return ElasticRaySettings(min_num_proc, max_num_proc, reset_limit, elastic_timeout,
                              timeout_s, nics, check_cooldown_range(cooldown_range), **rest)


class RayHosts(Discovery):
    """Ray's live nodes as hosts: ``slots`` each (see the module docstring), nodes without
    a slot left out. ``node_of`` maps a host back to its node id."""

    def __init__(self, cpus_per_slot: float, gpus_per_slot: float) -> None:
        self.cpus, self.gpus = cpus_per_slot, gpus_per_slot
        self.nodes: dict[str, str] = {}  # host -> node id

    def poll(self) -> Optional[list[HostSlots]]:
        hosts: list[HostSlots] = []
        for node in _live_nodes():
            res = node.get("Resources", {})
            slots = res.get("CPU", 0) // self.cpus if self.cpus else float("inf")
            if self.gpus:
                slots = min(slots, res.get("GPU", 0) // self.gpus)
            name = f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}"
            self.nodes[name] = node["NodeID"]
            if slots >= 1:
                hosts.append(HostSlots(name, int(slots)))
        return hosts

    def node_of(self, host: str) -> Optional[str]:
        return self.nodes.get(host)


class HorovodHosts(Discovery):
    """Horovod's discovery object (``find_available_hosts_and_slots()``: host -> slots),
    its hosts named by node IP address (or ``RayHosts``' names)."""

    def __init__(self, discovery: Any) -> None:
        self.discovery = discovery

    def poll(self) -> Optional[list[HostSlots]]:
        try:
            found = self.discovery.find_available_hosts_and_slots()
        except Exception as e:  # as a failing discovery script: keep the last list
            _say(f"host discovery {type(self.discovery).__name__} raised {e!r}; keeping the "
                 "last host list")
            return None
        return [HostSlots(str(h), int(n)) for h, n in found.items() if int(n) >= 1]

    @staticmethod
    def node_of(host: str) -> Optional[str]:
        for node in _live_nodes():
            if host in (node["NodeManagerAddress"], f"{node['NodeManagerAddress']}/"
                        f"{node['NodeID'][:8]}"):
                return node["NodeID"]
        return None


def _live_nodes() -> list[dict]:
    return sorted((n for n in ray.nodes() if n.get("Alive", n.get("alive"))),
                  key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))


class ActorProcess:
    """The driver's handle on one worker actor (``processes.WorkerProcess``)."""

    def __init__(self, wid: str, actor: Any, ref: Any) -> None:
        self.wid, self.actor, self.ref = wid, actor, ref
        self.where = f"actor {actor._actor_id.hex()[:12]}"
        self.code: Optional[int] = None
        self.record: Optional[dict] = None

    def poll(self) -> Optional[int]:
        if self.code is None and self.ref is None:  # closed while it ran: it is killed
            self.code = -9
        if self.code is None:
            done, _ = ray.wait([self.ref], timeout=0)
            if done:
                self.code = self._outcome()
        return self.code

    def _outcome(self) -> int:
        try:
            self.record = ray.get(self.ref)
        except ray.exceptions.RayActorError as e:
            _say(f"worker {self.wid}'s actor died: {_first_line(e)}")
            return -9
        except ray.exceptions.RayError as e:
            _say(f"worker {self.wid}: Ray failed its call: {_first_line(e)}")
            return 1
        return self.record.get("code", 0 if self.record["ok"] else 1)

    def terminate(self) -> None:
        self.kill()  # an actor has no gentler stop that reaches a busy function

    def kill(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    def close(self, timeout: float) -> None:
        # Ray relays the actor's output itself. Drop the handles now, while Ray is up: a
        # handle collected after ray.shutdown() (at exit) makes Ray end the process.
        self.actor = self.ref = None


class RaySpawner:
    """Starts worker actors running ``fn(*args, **kwargs)`` (``elastic.processes.Spawn``)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict,
                 cpus: float, gpus: float, discovery: Any) -> None:
        self.call, self.env = (fn, args, kwargs), env
        self.cpus, self.gpus, self.discovery = cpus, gpus, discovery
        self.handles: list[ActorProcess] = []

    def __call__(self, wid: str, host: HostSlots, slot: int, mine: dict) -> ActorProcess:
        node = self.discovery.node_of(host.host)
        if node is None:
            raise OSError(f"no live Ray node is host {host.host}")
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        actor = _remote_worker().options(num_cpus=self.cpus, num_gpus=self.gpus,
                                         scheduling_strategy=strategy).remote()
        ref = actor.elastic.remote({**self.env, **mine}, *self.call)
        handle = ActorProcess(wid, actor, ref)
        self.handles.append(handle)
        return handle


def driver_address() -> str:
    """The address the actors reach the driver at: its Ray node's IP address."""
    return ray.util.get_node_ip_address()


def run_job(what: str, fn: Callable[..., Any], args: tuple, kwargs: dict,
            settings: ElasticRaySettings, env: Mapping[str, str], cpus: float,
            gpus: float, discovery: Any) -> list:
    """One elastic job from start to end; the last generation's values in rank order."""
    hosts = discovery.poll() or []
    high = settings.max_num_proc or sys.maxsize
    start = max(settings.min_num_proc, min(high, sum(h.slots for h in hosts)))
    driver_settings = ElasticSettings(
        settings.min_num_proc, high, start, float(settings.elastic_timeout),
        settings.reset_limit, cooldown_range=settings.cooldown_range)
    spawn = RaySpawner(fn, args, kwargs, dict(env), cpus, gpus, discovery)
    driver = ElasticDriver(spawn, discovery, driver_settings, driver_address(), grace=5.0)
    code = drive(driver, None)
    records = [h.record for h in spawn.handles if h.record is not None]
    return tw.elastic_values(what, records, code, driver.failure)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class ElasticRayExecutor:
    """Elastic training on the whole Ray cluster (Horovod's ``ElasticRayExecutor``).

    Parameters
    ----------
    settings : ElasticRaySettings
        From ``ElasticRayExecutor.create_settings``.
    use_gpu : bool
        Whether each worker reserves ``gpus_per_slot`` GPUs (default 1).
    cpus_per_slot : float
        CPUs each worker reserves; a node has one slot per ``cpus_per_slot`` CPUs.
    gpus_per_slot : float, optional
        GPUs per worker; only with ``use_gpu``.
    env_vars : mapping, optional
        Variables set in every worker's environment (values made ``str``).
    override_discovery : bool
        True (default): the hosts are Ray's live nodes. False: ``settings.discovery``, an
        object with Horovod's ``find_available_hosts_and_slots()`` (node IP -> slots).

    Raises
    ------
    InvalidInputError
        GPUs without ``use_gpu``, nothing to reserve, no discovery object when
        ``override_discovery`` is false.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        nics: Union[None, str, Sequence[str]] = None,
                        min_np: Optional[int] = None, max_np: Optional[int] = None,
                        cooldown_range: Optional[Sequence[float]] = None,
                        verbose: int = 0, **kwargs: Any) -> ElasticRaySettings:
        """Settings of an elastic job (Horovod's arguments).

        Parameters
        ----------
        min_num_proc, max_num_proc : int
            Fewest workers to train with (below it the job waits up to
            ``elastic_timeout`` for nodes, then ends) and most (None: every slot of the
            cluster). ``min_np`` / ``max_np`` are Horovod's older names.
        reset_limit : int, optional
            End the job after this many resets.
        elastic_timeout : float
            Seconds a new generation may take to form (as ``ringrun --elastic-timeout``).
        timeout_s : float
            Seconds the ranks of a generation wait for each other when they connect.
        ssh_identity_file : str, optional
            Accepted and ignored: nothing runs over ssh.
        nics : str or collection of str, optional
            The one network interface the ranks talk over.
        cooldown_range : (float, float), optional
            Seconds a failed node's host is blacklisted for (as ``ringrun
            --blacklist-cooldown-range``); default: for good, as Horovod.
        verbose : int
            Accepted; the driver always logs generations and failures.
        **kwargs :
            Further Horovod settings (``discovery``...), kept on the settings.
        """
        return make_settings(min_np if min_np is not None else min_num_proc,
                             max_np if max_np is not None else max_num_proc, reset_limit,
                             elastic_timeout, timeout_s, nics, cooldown_range,
                             ssh_identity_file=ssh_identity_file, verbose=verbose,
                             **{k: v for k, v in kwargs.items() if k == "discovery"})

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[Mapping[str, Any]] = None,
                 override_discovery: bool = True) -> None:
        what = "ElasticRayExecutor"
        self.settings = settings
        self.cpus, self.gpus = worker_resources(what, cpus_per_slot, use_gpu, gpus_per_slot)
        if not override_discovery and settings.discovery is None:
            raise InvalidInputError(f"{what}: override_discovery=False needs "
                                    "settings.discovery (find_available_hosts_and_slots())")
        self.override = override_discovery
        self.env_vars = dict(env_vars or {})
        self.env: Optional[dict] = None

    def start(self) -> None:
        """Connect to Ray (``ray.init()`` when not connected) and prepare the workers'
        settings; the workers start in ``run``."""
        if not ray.is_initialized():
            ray.init()
        self.env = tw.driver_env(self.settings.timeout_s, self.settings.nics, self.env_vars)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Optional[Sequence[Callable[..., Any]]] = None) -> list:
        """Run ``worker_fn()`` as an elastic job until it returns on every rank.

        Returns
        -------
        list
            ``worker_fn``'s values on the last generation's ranks, in rank order.

        Raises
        ------
        Exception
            The last generation's error (its earliest rank that did not only lose a
            peer), with that rank's traceback as ``__cause__``; RingReduceError with the
            driver's reason when it ended the job (too few workers within
            ``elastic_timeout``, every node blacklisted, the reset limit).
        """
        if callbacks is not None:
            raise InvalidInputError("ElasticRayExecutor.run: callbacks are not supported; "
                                    "return the values from the function instead")
        return self.elastic_run("ElasticRayExecutor.run", worker_fn, (), {})

    def elastic_run(self, what: str, fn: Callable[..., Any], args: tuple,
                    kwargs: dict) -> list:
        """``run``'s work, for ``RayExecutor`` with ``min_workers`` too."""
        if self.env is None:
            raise InvalidInputError(f"{what}: the executor is not started; call start() "
                                    "first")
        discovery = (RayHosts(self.cpus, self.gpus) if self.override
                     else HorovodHosts(self.settings.discovery))
        return run_job(what, fn, args, kwargs, self.settings, self.env, self.cpus, self.gpus,
                       discovery)


def worker_resources(what: str, cpus: float, use_gpu: bool,
                     gpus: Optional[float]) -> tuple[float, float]:
    """(CPUs, GPUs) each worker reserves, checked as Horovod checks them."""
    if gpus is not None and not use_gpu:
        raise InvalidInputError(f"{what}: GPUs per worker are set but use_gpu is False; "
                                "set use_gpu=True to give the workers GPUs")
    gpus = (1 if gpus is None else gpus) if use_gpu else 0
    if (use_gpu and gpus <= 0) or cpus < 0 or not (cpus or gpus):
        raise InvalidInputError(f"{what}: {cpus} CPUs and {gpus} GPUs per worker: each "
                                "worker must reserve some CPUs or at least part of a GPU")
    return cpus, gpus
