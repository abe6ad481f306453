"""Collectives of a Communicator made of other collectives: Adasum, the grouped
allgather and reducescatter, and the object calls."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from ._adasum import Adasum, adasum_part, check_floating, gather_and_combine, in_engine
from ._arrays import for_reading, for_writing
from ._call_checks import Average, _members, _part, check_scales
from ._cuda_arrays import is_gpu_array
from ._handles import Handle, _HandleGroup
from .exceptions import InvalidInputError, call_label

# broadcast_object's header: the pickle's length (8 bytes), then its first bytes. The
# size of a call that folds into its negotiation round over shared memory (1 KiB).
_OBJECT_HEAD = 1024


class CompositeCalls:
    """Mixin of ``Communicator``: calls built from its other collectives."""

    def _adasum(self, xs: Sequence[Any], name: Optional[str], prescale: Any, postscale: Any,
                in_place: bool, grouped: bool) -> Handle:
        """An allreduce with ``op=Adasum`` (see ``_adasum``): in the engine when the set's size
        is a power of two, else a grouped allgather, then the same float64 combination on
        every rank; in place, the results are copied back."""
        what = ("grouped_allreduce" if grouped else "allreduce") + ("_" if in_place else "")
        if in_engine(self.size()):
            return self._adasum_engine(xs, name, prescale, postscale, in_place, grouped, what)
        try:
            pre, post = check_scales(prescale, postscale, what, name)
            srcs = [(for_writing if in_place else for_reading)(x, what, name)
                    for x in _members(xs, call_label(what, name))]
            inner, combine = gather_and_combine(self, srcs, name, pre, post, what)
        except InvalidInputError as err:
            # Refused before its allgathers: the others wait for each member's allgather.
            count = len(xs) if isinstance(xs, Sequence) else 0
            self._refuse_each("allgather", [adasum_part(name, i) for i in range(count)], err)
            raise

        def finish(gathered: list) -> Any:
            out = combine(gathered)
            if in_place:
                for dst, res in zip(srcs, out):
                    dst[...] = res
                out = list(xs)
            return out if grouped else out[0]

        return Handle(inner, lambda h: finish(h.wait()), (srcs,))

    def _adasum_engine(self, xs: Sequence[Any], name: Optional[str], prescale: Any,
                       postscale: Any, in_place: bool, grouped: bool, what: str) -> Handle:
        """``_adasum`` as one engine allreduce (or one fused group) with op Adasum: the
        engine's vector-halving exchange (csrc/collectives/allreduce_adasum.cc)."""
        convert = for_writing if in_place else for_reading
        if grouped:
            with self._refusing_group(name, xs):
                srcs = [convert(x, what, name) for x in _members(xs, call_label(what, name))]
                check_floating(srcs, call_label(what, name))
                outs = srcs if in_place else [self._outputs.empty_like(s) for s in srcs]
                core = self._submit_group(srcs, outs, Adasum, name, prescale, postscale)
            return self._track(core, lambda _: list(xs) if in_place else outs, (srcs, outs))
        with self._refusing("allreduce", name):
            src = convert(xs[0], what, name)
            check_floating([src], call_label(what, name))
        out = src if in_place else self._outputs.empty_like(src)
        core = self._submit_allreduce(src, out, Adasum, name, prescale, postscale, what)
        return self._track(core, lambda _: xs[0] if in_place else out, (src, out))

    def grouped_allgather_async(self, xs: Sequence[Any], name: Optional[str] = None) -> Handle:
        """Start an allgather of each of ``xs``, submitted together; the result is a list.

        Members are named ``<name>.<i>`` (unnamed: matched by order, like single calls).
        """
        what = call_label("grouped_allgather", name)
        if any(is_gpu_array(x) for x in _members(xs, what)):  # one row-count exchange
            return self._gpu_allgather(list(xs), name, grouped=True)
        handles = [self.allgather_async(x, _part(name, str(i)))
                   for i, x in enumerate(_members(xs, what))]
        return Handle(_HandleGroup(handles), lambda g: g.results)

    def grouped_allgather(self, xs: Sequence[Any], name: Optional[str] = None) -> list:
        """Allgather each of ``xs`` (see ``allgather``); returns a list of new arrays."""
        return self._wait(self.grouped_allgather_async(xs, name))

    def grouped_reducescatter_async(self, xs: Sequence[Any], op: int = Average,
                                    name: Optional[str] = None, prescale_factor: float = 1.0,
                                    postscale_factor: float = 1.0) -> Handle:
        """Start a reducescatter of each of ``xs``, submitted together; the result is a list."""
        what = call_label("grouped_reducescatter", name)
        handles = [self.reducescatter_async(x, op, _part(name, str(i)), prescale_factor,
                                            postscale_factor)
                   for i, x in enumerate(_members(xs, what))]
        return Handle(_HandleGroup(handles), lambda g: g.results)

    def grouped_reducescatter(self, xs: Sequence[Any], op: int = Average,
                              name: Optional[str] = None, prescale_factor: float = 1.0,
                              postscale_factor: float = 1.0) -> list:
        """Reducescatter each of ``xs`` (see ``reducescatter``); returns a list of new arrays."""
        return self._wait(self.grouped_reducescatter_async(xs, op, name, prescale_factor,
                                                           postscale_factor))

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
        """Return root_rank's ``obj`` (any picklable object) on every rank.

        One broadcast of a fixed-size header carrying the pickle's length and its first
        bytes (a small object travels whole in it: one folded call), then, for a larger
        object, one broadcast of the rest.
        """
        with self._refusing("broadcast", _part(name, "head")):  # its error names this call
            self._check_root(root_rank, call_label("broadcast_object", name))
        root, inline = self.rank() == root_rank, _OBJECT_HEAD - 8
        head, payload = bytearray(_OBJECT_HEAD), b""
        if root:
            payload = pickle.dumps(obj)
            struct.pack_into("<Q", head, 0, len(payload))
            head[8:8 + min(len(payload), inline)] = payload[:inline]
        self.broadcast_(np.frombuffer(head, np.uint8), root_rank, _part(name, "head"))
        (length,) = struct.unpack_from("<Q", head)
        if length > inline:
            rest = bytearray(payload[inline:]) if root else bytearray(length - inline)
            self.broadcast_(np.frombuffer(rest, np.uint8), root_rank, _part(name, "rest"))
        if root:
            return obj
        if length <= inline:
            return pickle.loads(memoryview(head)[8:8 + length])
        return pickle.loads(bytes(memoryview(head)[8:]) + rest)

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> list:
        """Return the list of every rank's ``obj``, in rank order: one allgather of each
        rank's pickle behind its length."""
        data = pickle.dumps(obj)
        gathered = memoryview(self.allgather(
            np.frombuffer(struct.pack("<Q", len(data)) + data, np.uint8), name))
        out, at = [], 0
        for _ in range(self.size()):
            (n,) = struct.unpack_from("<Q", gathered, at)
            out.append(pickle.loads(gathered[at + 8:at + 8 + n]))
            at += 8 + n
        return out
