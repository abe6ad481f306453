"""Start every rank from the same state: parameters, optimizer state, Python objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch

from ringreduce._state import agree as _agree
from ringreduce._state import collect_slots, join_skeleton, split_skeleton, wait_all
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._tensors import comm
from .movement import broadcast_async_

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]

Params = Union[Mapping[str, Any], Iterable[tuple[str, Any]]]


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` (tensors included) on every rank."""
    return comm(process_set).broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Return every rank's picklable ``obj`` as a list in rank order."""
    return comm(process_set).allgather_object(obj, name)


def agree(what: str, signature: Any, describe: str = "",
          process_set: ProcessSet = global_process_set) -> None:
    """``ringreduce._state.agree`` on the current communicator (collective)."""
    _agree(comm(process_set), what, signature, describe)


def _named_tensors(params: Params, what: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        try:
            items = list(params)
        except TypeError:
            items = None
        if items and all(isinstance(i, torch.Tensor) for i in items):
            items = [(str(i), t) for i, t in enumerate(items)]  # Horovod: by position
        if items is None or not all(isinstance(i, tuple) and len(i) == 2 for i in items):
            raise InvalidInputError(f"{what}: expected a state_dict, an iterable of "
                                    "(name, tensor) pairs such as model.named_parameters(), "
                                    "or a list of tensors such as list(model.parameters())")
    seen: set = set()
    out = []
    for name, t in items:
        if name in seen:
            raise InvalidInputError(f"{what}: the name {name!r} appears twice; names must be "
                                    "unique")
        seen.add(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{what}: {name!r} is a {type(t).__name__}, not a tensor; "
                                    "use broadcast_object() for other values")
        out.append((str(name), t))
    return out


def broadcast_parameters(params: Params, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's tensors in place with ``root_rank``'s.

    Collective. Checks first that all ranks pass the same names, shapes and
    dtypes (and raises the same error everywhere if not).

    Parameters
    ----------
    params : dict, iterable of (str, torch.Tensor), or list of torch.Tensor
        ``model.state_dict()`` (buffers included), ``model.named_parameters()``, or
        ``list(model.parameters())`` (matched across ranks by position).
    root_rank : int
        Rank whose values win.
    """
    what = "broadcast_parameters"
    items = _named_tensors(params, what)
    agree(what, [(n, (tuple(t.shape), str(t.dtype))) for n, t in items],
          " on the tensors to broadcast", process_set=process_set)
    handles, seen = [], set()
    with torch.no_grad():
        for name, t in items:
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if t.numel() and key in seen:  # tied weights: the same memory under two names
                continue
            seen.add(key)
            handles.append(broadcast_async_(t, root_rank, name=f"broadcast.{name}",
                                            process_set=process_set))
        wait_all(handles)


def _describe(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype


def _group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(g["params"]) for g in optimizer.param_groups]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    Collective. Works for any ``torch.optim.Optimizer`` (DistributedOptimizer
    included), also before the first step, when the state is still empty:
    every rank then ends up with empty state (and root's hyper-parameters), and
    the first step creates identical state everywhere.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer; every rank must have the same parameter groups.
    root_rank : int
        Rank whose state wins.
    """
    what = "broadcast_optimizer_state"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(f"{what}: expected a torch.optim.Optimizer, got "
                                f"{type(optimizer).__name__}")
    c = comm(process_set)
    tensors: list = []
    skeleton = split_skeleton(optimizer.state_dict(), tensors, torch.is_tensor,
                              _describe) if c.rank() == root_rank else None
    skeleton, groups = broadcast_object((skeleton, _group_sizes(optimizer)), root_rank,
                                        name=f"{what}.skeleton", process_set=process_set)
    mine = _group_sizes(optimizer)
    error = None if mine == groups else (f"rank {c.rank()} has parameter groups of sizes "
                                         f"{mine}, rank {root_rank} has {groups}")
    errors = [e for e in allgather_object(error, name=f"{what}.check", process_set=process_set)
              if e]
    if errors:
        raise InvalidInputError(f"{what}: " + "; ".join(errors))
    if c.rank() != root_rank:
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in collect_slots(skeleton)]
    else:  # the others receive on the host; load_state_dict moves state to each param's device
        tensors = [t.cpu() for t in tensors]
    with torch.no_grad():
        wait_all([broadcast_async_(t, root_rank, name=f"{what}.{i}", process_set=process_set)
                  for i, t in enumerate(tensors)])
    if c.rank() != root_rank:
        optimizer.load_state_dict(join_skeleton(skeleton, tensors))
