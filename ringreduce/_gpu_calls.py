"""The collectives of a Communicator on GPU arrays (CuPy, torch CUDA, DLPack CUDA):
argument checks and result allocation here, the work in the engine's GPU executor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

from ._call_checks import _check_op, check_scales
from ._cuda_arrays import is_gpu_array
from ._gpu_collectives import ALLREDUCE, BROADCAST, REDUCESCATTER
from ._handles import Handle
from .exceptions import InvalidInputError, call_label


class GpuCalls:
    """Mixin of ``Communicator``: its GPU-array paths (uses its engine, lock and names)."""

    def _gpu_allreduce(self, xs: Sequence[Any], in_place: bool, op: Any, name: Optional[str],
                       prescale: Any, postscale: Any, what: str,
                       result: Callable[[list], Any], grouped: bool = False) -> Handle:
        """An allreduce of GPU arrays (one, or a fused group) through the GPU executor."""
        op = _check_op(op, call_label(what, name))
        pre, post = check_scales(prescale, postscale, what, name)
        if not all(is_gpu_array(x) for x in xs) or not xs:
            raise InvalidInputError(f"{call_label(what, name)}: a group is either all GPU "
                                    "arrays or all host arrays, and not empty")
        ins = self._gpu.views(xs, what, name)
        outs = None if in_place else self._gpu.results(ins, what, name)
        with self._lock:  # the unnamed-group counter advances only when the engine took it
            group = self._group_name(name) if grouped else ""
            names = [f"{group}.{i}" for i in range(len(ins))] if grouped else [self._name(name)]
            core = self._gpu.submit(ALLREDUCE, ins, outs, names, group, op, pre, post)
            self._groups += grouped and name is None
        results = [o.obj for o in outs] if outs else list(xs)
        return self._track(core, lambda _: result(results), (ins, outs))

    def _gpu_broadcast(self, x: Any, in_place: bool, root_rank: int, name: Optional[str],
                       what: str) -> Handle:
        """A broadcast of a GPU array: NCCL's broadcast from ``x`` into itself or a new array."""
        root = self._check_root(root_rank, call_label(what, name))
        ins = self._gpu.views([x], what, name)
        outs = None if in_place else self._gpu.results(ins, what, name)
        core = self._gpu.submit(BROADCAST, ins, outs, [self._name(name)], root=root)
        return self._track(core, lambda _: outs[0].obj if outs else x, (ins, outs))

    def _gpu_reducescatter(self, x: Any, op: Any, name: Optional[str], prescale: Any,
                           postscale: Any) -> Handle:
        """A reducescatter of a GPU array: this rank's rows in a new array of its type."""
        what = call_label("reducescatter", name)
        op = _check_op(op, what)
        pre, post = check_scales(prescale, postscale, "reducescatter", name)
        ins = self._gpu.views([x], "reducescatter", name)
        if not ins[0].shape:
            raise InvalidInputError(f"{what}: needs at least one dimension")
        rows, n = ins[0].shape[0], self.size()
        mine = rows // n + (self.rank() < rows % n)  # lower ranks get the extra rows
        outs = self._gpu.results(ins, "reducescatter", name, [(mine, *ins[0].shape[1:])])
        core = self._gpu.submit(REDUCESCATTER, ins, outs, [self._name(name)], "", op, pre, post)
        return self._track(core, lambda _: outs[0].obj, (ins, outs))
