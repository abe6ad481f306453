"""The collectives of a Communicator on GPU arrays (CuPy, torch CUDA, DLPack CUDA):
argument checks and result allocation here, the work in the engine's GPU executor.

Allgather and alltoall results are allocated by the array's framework, so their row
count must be known when the call is submitted: the call first exchanges the row counts
(allgather) or the splits (alltoall) with a small host allgather of int64s named
``<name>.rows`` / ``<name>.splits`` (unnamed calls: the next unnamed names, in order), then
submits the GPU collective with every rank's counts. The ``_async`` forms therefore return
after that exchange, i.e. once every rank has made the call. A rank that has joined gives
no rows to the allgather's exchange (its count is 0); an alltoall cannot run while one has."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np

from ._call_checks import _check_op, _part, check_scales
from ._cuda_arrays import is_gpu_array
from ._gpu_collectives import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BROADCAST,
    FLOAT32,
    FLOAT64,
    REDUCESCATTER,
    WIRES,
    wire_code,
)
from ._handles import Handle, _HandleGroup
from .exceptions import InvalidInputError, call_label


class GpuCalls:
    """Mixin of ``Communicator``: its GPU-array paths (uses its engine, lock and names)."""

    def _gpu_allreduce(self, xs: Sequence[Any], in_place: bool, op: Any, name: Optional[str],
                       prescale: Any, postscale: Any, what: str,
                       result: Callable[[list], Any], grouped: bool = False,
                       compression: Optional[str] = None) -> Handle:
        """An allreduce of GPU arrays (one, or a fused group) through the GPU executor;
        ``compression`` ('fp16' / 'bf16'): float32 / float64 arrays travel as float16 /
        bfloat16, cast by the executor's pack and unpack kernels."""
        op = _check_op(op, call_label(what, name))
        pre, post = check_scales(prescale, postscale, what, name)
        if not all(is_gpu_array(x) for x in xs) or not xs:
            raise InvalidInputError(f"{call_label(what, name)}: a group is either all GPU "
                                    "arrays or all host arrays, and not empty")
        ins = self._gpu.views(xs, what, name)
        wire = wire_code(compression, ins, call_label(what, name))
        outs = None if in_place else self._gpu.results(ins, what, name)
        with self._lock:  # the unnamed-group counter advances only when the engine took it
            group = self._group_name(name) if grouped else ""
            names = [f"{group}.{i}" for i in range(len(ins))] if grouped else [self._name(name)]
            core = self._gpu.submit(ALLREDUCE, ins, outs, names, group, op, pre, post,
                                    wire=wire)
            self._groups += grouped and name is None
        results = [o.obj for o in outs] if outs else list(xs)
        return self._track(core, lambda _: result(results), (ins, outs))

    def allreduce_gpu_view_(self, x: Any, ptr: int, shape: Sequence[int], code: int,
                            device: int, stream: int, op: int, name: str, prescale: float,
                            postscale: float, compression: Optional[str] = None,
                            track: bool = True) -> Any:
        """Start an in-place allreduce of GPU array ``x``, described by the caller.

        The per-gradient path of a framework layer (``DistributedOptimizer`` on CUDA):
        the layer reads the array's address, shape, dtype and stream from its own tensor
        type (a few attribute reads) and vouches for them, so nothing is converted or
        checked here but the device.

        Parameters
        ----------
        x : GPU array
            Kept alive by the handle until it is done; ``wait()`` returns it.
        ptr, shape, code, device, stream : int, sequence of int, int, int, int
            Its C-contiguous memory's device address, its shape, its dtype's core code
            (``ringreduce._gpu_collectives``), its CUDA device, and the stream that
            produced it (0: the legacy default stream).
        op, name, prescale, postscale
            As for ``allreduce_async_``; ``op`` a plain int (not Adasum), ``name`` a str.
        compression : {None, 'fp16', 'bf16'}
            float32 / float64 travel as float16 / bfloat16, cast by the GPU kernels.
        track : bool
            False: the caller keeps the handle until it is done or waited for on the
            stream that allocated ``x`` (see ``_gpu_collectives.wait_on_stream``); the
            Communicator then does not keep ``x`` alive itself.

        Returns
        -------
        handle
            ``wait()`` returns ``x`` once it holds the result; ``done()`` polls.
        """
        wire = WIRES[compression] if compression and code in (FLOAT32, FLOAT64) else -1
        h = self._gpu.allreduce_view_(x, ptr, shape, code, device, stream, name, op, prescale,
                                      postscale, wire)
        if not track:
            return h
        q = self._in_flight  # as allreduce_async_'s numpy path: the length cap only
        q.append(h)
        if len(q) >= self._prune_at:
            self.release_done()
        return h

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

    def _gpu_allgather(self, xs: Sequence[Any], name: Optional[str],
                       grouped: bool = False) -> Handle:
        """Allgathers of GPU arrays with any first dimension: every rank's row counts in one
        host exchange, then NCCL's allgather (padded when they differ) of each into a new
        array. ``grouped``: ``grouped_allgather`` (members ``<name>.<i>``, a list back)."""
        op = "grouped_allgather" if grouped else "allgather"
        what, rows_name = call_label(op, name), _part(name, "rows")
        names = [_part(name, str(i)) for i in range(len(xs))] if grouped else [name]
        with self._refusing("allgather", rows_name):  # peers wait in the count exchange
            if not all(is_gpu_array(x) for x in xs):
                raise InvalidInputError(f"{what}: a group is either all GPU arrays or all "
                                        "host arrays")
            ins = [self._gpu.views([x], op, name)[0] for x in xs]
            if not all(v.shape for v in ins):
                raise InvalidInputError(f"{what}: needs arrays of at least one dimension")
        # Each rank sends its rank and its counts: a rank that has joined sends no row,
        # and its arrays count 0 rows (the executor agrees on that with it).
        sent = self.allgather(np.array([self.rank(), *(v.shape[0] for v in ins)], np.int64),
                              rows_name).reshape(-1, 1 + len(ins))
        table = np.zeros((self.size(), len(ins)), np.int64)
        table[sent[:, 0]] = sent[:, 1:]
        handles = []
        for i, (v, member) in enumerate(zip(ins, names)):
            rows = [int(k) for k in table[:, i]]
            outs = self._gpu.results([v], op, member, [(sum(rows), *v.shape[1:])])
            core = self._gpu.submit(ALLGATHER, [v], outs, [self._name(member)], peer_rows=rows)
            handles.append(self._track(core, lambda _, o=outs[0]: o.obj, (v, outs)))
        return Handle(_HandleGroup(handles), lambda g: g.results) if grouped else handles[0]

    def _gpu_alltoall(self, x: Any, splits: Optional[Sequence[int]],
                      name: Optional[str]) -> Handle:
        """An alltoall of a GPU array: every rank's splits over the host, then NCCL's
        grouped sends and receives into a new array; with ``splits``, also the rows
        received from each rank."""
        what, splits_name, n = call_label("alltoall", name), _part(name, "splits"), self.size()
        given = splits is not None
        with self._refusing("allgather", splits_name):  # peers wait in the splits exchange
            ins = self._gpu.views([x], "alltoall", name)
            if not ins[0].shape:
                raise InvalidInputError(f"{what}: needs at least one dimension")
            rows = ins[0].shape[0]
            if not given and rows % n:
                raise InvalidInputError(f"{what}: axis 0 ({rows}) does not divide by size {n}; "
                                        "pass splits=")
            send = [int(s) for s in splits] if given else [rows // n] * n
            if len(send) != n or min(send) < 0 or sum(send) != rows:
                raise InvalidInputError(f"{what}: splits must have one entry per rank ({n}) "
                                        f"summing to dim 0 ({rows}); got {send}")
        table = self.allgather(np.asarray(send, np.int64), splits_name)
        if table.size != n * n:  # as on the host, where the negotiator refuses it
            raise InvalidInputError(f"{what}: cannot run while a rank has joined (only "
                                    "allreduce, allgather and broadcast can)")
        received = table.reshape(n, n)[:, self.rank()]
        outs = self._gpu.results(ins, "alltoall", name, [(int(received.sum()),
                                                          *ins[0].shape[1:])])
        core = self._gpu.submit(ALLTOALL, ins, outs, [self._name(name)], splits=send,
                                peer_rows=[int(r) for r in received])

        def finish(_: Any) -> Any:
            return (outs[0].obj, received.astype(np.int64)) if given else outs[0].obj

        return self._track(core, finish, (ins, outs))
