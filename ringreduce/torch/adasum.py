"""``DistributedOptimizer(op=Adasum)``: Horovod's delta optimizer.

Each rank applies the wrapped optimizer to its own gradients, then the parameter
*changes* (not the gradients) are combined across ranks with Adasum
(``ringreduce._adasum``) and every rank sets its parameters to the starting values plus
that combination. This is what ``horovod.torch.DistributedOptimizer(op=hvd.Adasum)``
does (its ``_DistributedAdasumOptimizer``), so a script's learning rate means what it
meant under Horovod (not scaled by ``size``).

Protocol per ``step()``: (1) every registered parameter, in name order (the same on
every rank), is copied; (2) the wrapped ``step()`` runs; (3) one grouped Adasum
allreduce of the differences, one tensor per parameter; (4) ``p = start + combined``.
Every rank reduces every parameter, with or without a gradient (its difference is then
zero, which Adasum treats as contributing nothing), so the collectives always match.
Communication happens in ``step()``; nothing overlaps the backward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch

from ringreduce._adasum import Adasum
from ringreduce.elastic import in_elastic_job
from ringreduce.process_sets import ProcessSet

from ._tensors import binder, instance_index, to_numpy, to_torch
from .broadcast import agree
from .compression import Compressor

_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Communicator -> count


class _AdasumMixin:
    """Methods put in front of the wrapped optimizer's class (see DistributedOptimizer)."""

    def _rr_adasum_setup(self, named: dict, compression: type[Compressor],
                         process_set: Optional[ProcessSet] = None) -> None:
        self._rr_comm = binder(process_set)
        index = instance_index(_INSTANCES, self._rr_comm())
        self._rr_name = "adasum.delta" if index == 0 else f"adasum{index}.delta"
        self._rr_compression = compression
        self._rr_params = sorted(((n, p) for p, n in named.items()), key=lambda np_: np_[0])
        self._rr_original: Callable[[], Any] = lambda: None
        if not in_elastic_job():  # there, a late worker constructs it while others do not
            agree("DistributedOptimizer(op=Adasum)",
                  [(n, (tuple(p.shape), str(p.dtype))) for n, p in self._rr_params],
                  " on the parameters", process_set=process_set)

    def synchronize(self) -> None:
        """Nothing to wait for: with Adasum the parameter changes are combined in step()."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Accepted for Horovod compatibility; step() combines the changes either way."""
        yield

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step the wrapped optimizer locally, then combine the parameter changes with Adasum."""
        params = [p for _, p in self._rr_params]
        starts = [p.detach().clone() for p in params]
        out = super().step(closure)
        packed = [self._rr_compression.compress(p.detach() - s) for p, s in zip(params, starts)]
        arrays = [to_numpy(b.contiguous(), f"DistributedOptimizer(op=Adasum) {n!r}")
                  for (n, _), (b, _) in zip(self._rr_params, packed)]
        combined = self._rr_comm().grouped_allreduce(arrays, Adasum, self._rr_name)
        with torch.no_grad():
            for p, s, r, (_, ctx) in zip(params, starts, combined, packed):
                p.copy_(s + self._rr_compression.decompress(to_torch(r), ctx))
        original = self._rr_original()
        if original is not None:  # an LR scheduler made on it before wrapping checks this
            original._opt_called = True
        return out
