"""Rank-0 checkpoints: atomic save on one rank, load on one rank and broadcast to all."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ringreduce.checkpoint import CheckpointError, load_on_root, save_on_root

from ._tensors import comm

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


def _plain(value: Any) -> Any:
    """What gets saved for ``value``: its ``state_dict()`` if it has one (models, optimizers)."""
    state_dict = getattr(value, "state_dict", None)
    return state_dict() if callable(state_dict) else value


def save_checkpoint(path: str, root_rank: int = 0, **state: Any) -> bool:
    """Write ``state`` to ``path`` on ``root_rank`` only, atomically; other ranks return at once.

    Not collective. Objects with a ``state_dict()`` method (models, optimizers, LR
    schedulers, GradScalers) are saved as their state dicts; other values as they
    are (``torch.save``). The file is written to a temporary file in the same
    directory, fsynced and renamed over ``path``, so a crash leaves the previous
    checkpoint intact.

    Parameters
    ----------
    path : str
        Target file; its directory is created if missing.
    root_rank : int
        The rank that writes (default 0).
    **state
        E.g. ``model=model, optimizer=opt, epoch=3``.

    Returns
    -------
    bool
        True on the rank that wrote the file.

    Raises
    ------
    CheckpointError
        On the writing rank, if the file cannot be written.
    """
    if comm().rank() != root_rank:
        return False
    payload = {key: _plain(value) for key, value in state.items()}
    return save_on_root(comm(), path, root_rank, lambda f: torch.save(payload, f))


def _reader(weights_only: bool) -> Callable[[str], dict]:
    def read(path: str) -> dict:
        try:
            data = torch.load(path, map_location="cpu", weights_only=weights_only)
        except Exception as err:
            if weights_only and "weights_only" in str(err):
                raise CheckpointError(
                    f"cannot read checkpoint {path!r}: {type(err).__name__}: {err} (saved "
                    "objects other than tensors and plain Python values need "
                    "weights_only=False)") from err
            raise
        if not isinstance(data, dict):
            raise CheckpointError(f"{path!r} is not a checkpoint written by save_checkpoint()")
        return data

    return read


def load_checkpoint(path: str, root_rank: int = 0, missing_ok: bool = False,
                    weights_only: bool = True, **targets: Any) -> Optional[dict]:
    """Read ``path`` on ``root_rank``, broadcast it, and load it into ``targets`` on every rank.

    Collective. Only the root reads the file (other ranks need not see it), so
    every rank resumes from identical values.

    Parameters
    ----------
    path : str
        A file written by ``save_checkpoint``.
    root_rank : int
        The rank that reads (default 0).
    missing_ok : bool
        If the file does not exist, return None on every rank instead of raising.
    weights_only : bool
        Passed to ``torch.load``: True (default) allows tensors and plain Python
        values only; use False for checkpoints holding other objects you trust.
    **targets
        Objects to restore with ``load_state_dict``, by the key they were saved
        under, e.g. ``model=model, optimizer=opt``.

    Returns
    -------
    dict or None
        Everything in the checkpoint (state dicts for the targets), e.g.
        ``ckpt["epoch"]``; None if the file is missing and ``missing_ok``.

    Raises
    ------
    CheckpointError
        On every rank alike, if the file is missing, unreadable or lacks a target's key.
    """
    data = load_on_root(comm(), path, root_rank, _reader(weights_only), missing_ok)
    if data is None:
        return None
    absent = sorted(k for k in targets if k not in data)
    if absent:
        raise CheckpointError(f"load_checkpoint: {path!r} has no entries {absent} (it holds "
                              f"{sorted(data)})")
    for key, target in targets.items():
        target.load_state_dict(data[key])
    return data
