"""Where a ``RayExecutor``'s actors run: the resources each one takes and the placement group
that holds them (the current one, or one made for the executor), as Horovod's strategies."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .. import _task_world as tw
from ..exceptions import RingReduceTimeoutError
from ._worker import Worker


@dataclass(frozen=True)
class Layout:
    """The actors asked for: ``num_workers`` anywhere, or ``per_host`` on each of
    ``num_hosts`` distinct nodes."""

    num_workers: Optional[int]
    num_hosts: Optional[int]
    per_host: int
    cpus: float   # per actor
    gpus: float   # per actor; 0 without use_gpu
    use_current: bool

    @property
    def size(self) -> int:
        return self.num_workers if self.num_workers is not None else self.num_hosts * self.per_host

    def bundle(self, actors: int) -> dict[str, float]:
        """The resources of ``actors`` actors, as one placement-group bundle."""
        out = {"CPU": self.cpus * actors}
        if self.gpus:
            out["GPU"] = self.gpus * actors
        return {k: v for k, v in out.items() if v}


class Placement:
    """The placement group of one started executor, and which bundle each actor takes.

    Inside a placement group already (a Ray Tune trial) it is that one, with any bundle
    per actor, unless ``use_current`` is false; otherwise a new one: ``STRICT_SPREAD``
    with one bundle per host (``num_hosts``), else ``PACK`` with one per worker. The
    constructor waits until Ray has reserved it, for ``timeout`` seconds at most.
    """

    def __init__(self, layout: Layout, timeout: float) -> None:
        self.layout = layout
        current = get_current_placement_group() if layout.use_current else None
        self.created = current is None
        if current is not None:
            self.group, self.bundles = current, [-1] * layout.size
        elif layout.num_hosts is not None:
            self.group = placement_group([layout.bundle(layout.per_host)] * layout.num_hosts,
                                         strategy="STRICT_SPREAD")
            self.bundles = [i // layout.per_host for i in range(layout.size)]
        else:
            self.group = placement_group([layout.bundle(1)] * layout.size, strategy="PACK")
            self.bundles = list(range(layout.size))
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            wanted = self.group.bundle_specs
            self.release()
            raise RingReduceTimeoutError(
                f"RayExecutor.start: Ray could not reserve {len(wanted)} bundle(s) of "
                f"{wanted[0]} ({'one per node' if layout.num_hosts else 'packed'}) within "
                f"placement_group_timeout_s={timeout:g} s; the cluster has "
                f"{ray.available_resources()} free. Ask for fewer workers or resources, "
                "or add nodes")

    def actor(self, index: int) -> Any:
        """A new actor for worker ``index`` (a handle; Ray starts it in the background)."""
        strategy = PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=self.bundles[index],
            placement_group_capture_child_tasks=False)
        return _remote_worker().options(num_cpus=self.layout.cpus, num_gpus=self.layout.gpus,
                                        scheduling_strategy=strategy).remote()

    def release(self) -> None:
        """Give the placement group back, if the executor made it."""
        if self.created:
            remove_placement_group(self.group)
            self.created = False


@functools.cache
def _remote_worker() -> Any:
    """The actor class (made once: Ray ships a class to the cluster when it is made)."""
    return ray.remote(Worker)


def visible_devices(workers: Sequence[tw.Worker],
                    gpu_ids: Sequence[Sequence[str]]) -> list[Optional[str]]:
    """Each worker's ``CUDA_VISIBLE_DEVICES``: the GPUs Ray gave all workers of its host,
    in rank order, so that a rank's own GPU is device ``local_rank()`` (with one GPU per
    worker) and a host's ranks see each other's devices, as in Horovod. None for a host
    without GPUs."""
    on_host: dict[str, list[str]] = {}
    for i in tw.rank_order(workers):
        on_host.setdefault(workers[i].host, []).extend(gpu_ids[i])
    return [",".join(on_host[w.host]) or None for w in workers]
