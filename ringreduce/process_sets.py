"""Process sets (Horovod's ``hvd.ProcessSet``): collectives among a subset of the ranks.

Written once for every framework layer. A ``ProcessSet`` is registered with a rank's
Communicator, statically at ``init(process_sets=[...])`` or, when dynamic sets are on
(``init(process_sets="dynamic")``, ``RINGREDUCE_DYNAMIC_PROCESS_SETS=1`` or Horovod's
``HOROVOD_DYNAMIC_PROCESS_SETS=1``), by ``add_process_set`` / ``remove_process_set``, which
every rank must call identically and in the same order (checked: ranks that disagree get a
``MismatchError``). Members reach the set through a ``ProcessSetCommunicator``; the engine
counts a set's tensor ready when its members have submitted it and runs it on the members'
own ring (csrc/transport/context_group.cc). A rank outside the set that calls into it gets an
``InvalidInputError`` naming the rank and the set.

As in Horovod, a static set may also be given as an mpi4py communicator (under ``mpirun``,
where ringreduce's ranks are ``MPI.COMM_WORLD``'s): each rank passes its own communicator
(``COMM_WORLD.Split(color, key)`` gives every rank a different one), ``init`` gathers every
rank's members and registers each distinct set, on every rank in the same order, and the
rank's own object becomes the set it belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from .exceptions import InvalidInputError, MismatchError

if TYPE_CHECKING:
    from ._communicator import Communicator


class ProcessSet:
    """A subset of the job's ranks that runs collectives of its own.

    Parameters
    ----------
    ranks : sequence of int, or mpi4py.MPI.Comm
        Global ranks of the members (any order; kept sorted, as Horovod does), or an MPI
        communicator this rank belongs to (for ``init(process_sets=...)`` only).
    """

    mpi_comm: Any = None

    def __init__(self, ranks: Union[Sequence[int], Any]) -> None:
        if hasattr(ranks, "Get_group") and hasattr(ranks, "Get_size"):
            self.mpi_comm = ranks
            ranks = _world_ranks(ranks)
        if isinstance(ranks, (str, bytes)) or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise InvalidInputError(f"ProcessSet needs a sequence of int ranks, got {ranks!r}")
        self.ranks: list[int] = sorted(set(int(r) for r in ranks))
        if len(self.ranks) != len(list(ranks)) or not self.ranks or self.ranks[0] < 0:
            raise InvalidInputError(f"ProcessSet needs distinct non-negative ranks, got {ranks!r}")
        self.process_set_id: Optional[int] = None
        self._registry: Optional[ProcessSetRegistry] = None

    def _comm(self) -> Communicator:
        if self._registry is None:
            raise InvalidInputError(f"{self!r} is not registered: pass it to "
                                    "init(process_sets=[...]) or add_process_set()")
        return self._registry.comm

    def included(self) -> bool:
        """True if this process is a member."""
        return self._comm().rank() in self.ranks

    def rank(self) -> Optional[int]:
        """This process's rank within the set, or None if it is not a member."""
        r = self._comm().rank()
        return self.ranks.index(r) if r in self.ranks else None

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of whichever communicator is current (id 0, never removed)."""

    def __init__(self) -> None:
        self.process_set_id = 0
        self._registry = None

    @property
    def ranks(self) -> list[int]:  # type: ignore[override]
        from . import _comm

        return list(range(_comm().size()))

    def _comm(self) -> Communicator:
        from . import _comm

        return _comm()


global_process_set: ProcessSet = _GlobalProcessSet()


def _world_ranks(comm: Any) -> list:
    """The ``MPI.COMM_WORLD`` ranks of the members of mpi4py communicator ``comm``."""
    from mpi4py import MPI

    if comm == MPI.COMM_NULL:
        raise InvalidInputError("ProcessSet(comm): this rank is not in the communicator "
                                "(MPI.COMM_NULL); pass a communicator of which it is a member")
    world = MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                              world))
    finally:
        world.Free()

SetArg = Union[ProcessSet, Sequence[int]]


def dynamic_from_env() -> bool:
    """RINGREDUCE_DYNAMIC_PROCESS_SETS (or Horovod's HOROVOD_DYNAMIC_PROCESS_SETS) is 1."""
    value = os.environ.get("RINGREDUCE_DYNAMIC_PROCESS_SETS",
                           os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0"))
    return value.strip().lower() in ("1", "true", "yes", "on")


class ProcessSetRegistry:
    """The process sets of one Communicator (one rank), by id; global is 0."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.dynamic = dynamic_from_env()
        self._sets: dict[int, ProcessSet] = {}
        self._views: dict[int, Communicator] = {}
        self._next_id = 1

    def setup(self, process_sets: Union[None, str, Sequence[ProcessSet]]) -> None:
        """``init(process_sets=...)``: "dynamic", or static sets registered on every rank."""
        if process_sets is None:
            return
        if isinstance(process_sets, str):
            if process_sets != "dynamic":
                raise InvalidInputError(f"init(process_sets={process_sets!r}): expected "
                                        "'dynamic' or a list of ProcessSet")
            self.dynamic = True
            return
        sets = [self._checked(p) for p in process_sets]
        from_comm = [p.mpi_comm is not None for p in sets]
        self._agree([None if c else p.ranks for p, c in zip(sets, from_comm)],
                    "init(process_sets=...)")
        everyone = [[p.ranks for p in sets]]
        if any(from_comm):
            self._check_mpi_world()
            everyone = self.comm.allgather_object(everyone[0], name="process_sets.members")
        for i, p in enumerate(sets):
            # From a communicator, each rank has its own: every distinct set, lowest first.
            for ranks in sorted({tuple(theirs[i]) for theirs in everyone}):
                mine = list(ranks) == p.ranks
                if any(q.ranks == list(ranks) for q in self._sets.values()):
                    raise InvalidInputError(f"init(process_sets=...): a process set with ranks "
                                            f"{list(ranks)} is given twice")
                self._register(p if mine else ProcessSet(ranks))

    def add(self, process_set: SetArg) -> ProcessSet:
        """``add_process_set``: collective over every rank of the job."""
        if not self.dynamic:
            raise InvalidInputError(
                "add_process_set needs dynamic process sets: init(process_sets='dynamic') or "
                "RINGREDUCE_DYNAMIC_PROCESS_SETS=1 (Horovod's HOROVOD_DYNAMIC_PROCESS_SETS)")
        if getattr(process_set, "mpi_comm", None) is not None:
            raise InvalidInputError("add_process_set: a set made from an MPI communicator can "
                                    "be given to init(process_sets=...) only (as in Horovod); "
                                    "build it from a list of ranks instead")
        p = self._checked(process_set)
        self._agree(p.ranks, f"add_process_set (id {self._next_id})")
        return self._register(p)

    def remove(self, process_set: ProcessSet) -> bool:
        """``remove_process_set``: collective; False if it was not registered here."""
        if not self.dynamic:
            raise InvalidInputError("remove_process_set needs dynamic process sets (see "
                                    "add_process_set)")
        pid = getattr(process_set, "process_set_id", None)
        if pid == 0:
            raise InvalidInputError("the global process set cannot be removed")
        self._agree(pid, "remove_process_set")
        found = self._sets.pop(pid, None) if pid is not None else None
        self._views.pop(pid, None)
        if found is not None:
            found.process_set_id, found._registry = None, None
        return found is not None

    def by_id(self, process_set_id: int, what: str) -> ProcessSet:
        """The set registered as ``process_set_id`` (Horovod's ``size_op(process_set_id)``)."""
        if process_set_id == 0:
            return global_process_set
        found = self._sets.get(process_set_id)
        if found is None:
            raise InvalidInputError(f"{what}: no process set has id {process_set_id!r} on rank "
                                    f"{self.comm.rank()} (registered: "
                                    f"{sorted(self._sets) or 'none'})")
        return found

    def communicator(self, process_set: Optional[ProcessSet], what: str) -> Communicator:
        """The communicator a call on ``process_set`` goes through, on this rank."""
        if process_set is None or process_set.process_set_id == 0:
            return self.comm
        pid = process_set.process_set_id
        if pid is None or self._sets.get(pid) is not process_set:
            raise InvalidInputError(f"{what}: {process_set!r} is not registered on rank "
                                    f"{self.comm.rank()} (init(process_sets=...) or "
                                    "add_process_set())")
        view = self._views.get(pid)
        if view is None:
            if self.comm.rank() not in process_set.ranks:
                raise InvalidInputError(
                    f"{what}: rank {self.comm.rank()} is not a member of process set {pid} "
                    f"(ranks {process_set.ranks}); only members may call its collectives")
            from ._communicator import ProcessSetCommunicator

            view = self._views[pid] = ProcessSetCommunicator(self.comm, process_set.ranks)
        return view

    def _checked(self, p: SetArg) -> ProcessSet:
        if not isinstance(p, ProcessSet):
            p = ProcessSet(p)
        if p.process_set_id is not None:
            raise InvalidInputError(f"{p!r} is already registered")
        if p.ranks[-1] >= self.comm.size():
            raise InvalidInputError(f"{p!r}: ranks must be in [0, {self.comm.size()})")
        if any(q.ranks == p.ranks for q in self._sets.values()):
            raise InvalidInputError(f"a process set with ranks {p.ranks} is already registered")
        return p

    def _register(self, p: ProcessSet) -> ProcessSet:
        p.process_set_id, p._registry = self._next_id, self
        self._sets[self._next_id] = p
        self._next_id += 1
        return p

    def _check_mpi_world(self) -> None:
        """Sets from MPI communicators count ranks of MPI.COMM_WORLD: it must be this job."""
        from mpi4py import MPI

        world = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
        if world != (self.comm.rank(), self.comm.size()):
            raise InvalidInputError(
                f"init(process_sets=...): a ProcessSet made from an MPI communicator needs "
                f"ringreduce started by mpirun (rank {self.comm.rank()} of {self.comm.size()} "
                f"here is rank {world[0]} of {world[1]} in MPI.COMM_WORLD)")

    def _agree(self, value: Any, what: str) -> None:
        """Every rank passed the same ``value`` (a collective over the whole job)."""
        everyone = self.comm.allgather_object(value, name=f"process_sets.{self._next_id}")
        if any(v != everyone[0] for v in everyone):
            lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
            raise MismatchError(f"{what} must be called identically on every rank: {lines}")
