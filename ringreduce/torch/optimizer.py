"""DistributedOptimizer: wrap any torch optimizer so that step() applies averaged gradients.

How it works (Horovod's design):

* A post-accumulate-grad hook on every parameter starts that gradient's
  allreduce (in place on ``p.grad``, named ``grad.<parameter name>``) the moment
  backward has accumulated it, so communication overlaps the rest of backward.
  With ``backward_passes_per_step=k`` the allreduce starts on the k-th pass.
* ``step()`` (or an explicit ``synchronize()``) waits for all of them, then runs
  the wrapped optimizer's own ``step``.
* Parameters whose hook did not fire this step do not hang anyone: in
  ``synchronize()`` the ranks allreduce one small "who has a gradient" count,
  and every rank without a gradient for a parameter that some rank has one for
  joins that allreduce with zeros. Parameters no rank has a gradient for keep
  ``grad = None``, exactly as in a single process.
* Every collective here is an allreduce or (sparse gradients) an allgather, so
  a rank that has called ``join()`` answers them with neutral elements and the
  others' steps average over the ranks that still have data.
* In an elastic job (``ringrun --min-np``) the constructor runs no collective: a worker
  that joins later constructs its optimizer while the others, after a reset, do not.
  ``elastic_setup()`` (run by ``TorchState.sync()`` on every rank at the start of each
  generation) agrees on the parameters and lays the buckets out on the current
  communicator; ``elastic_drop()`` (after a reset) forgets the closed generation. Until
  set up, gradients are averaged without buckets.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np
import torch

from ringreduce import Average, Communicator, Sum
from ringreduce._adasum import Adasum
from ringreduce._horovod import check_passes, optimizer_scales
from ringreduce.elastic import after_reset, in_elastic_job
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._tensors import (
    allreduce_cuda_,
    binder,
    current_stream,
    instance_index,
    to_numpy,
    wait_cuda_,
)
from .adasum import _AdasumMixin
from .broadcast import agree
from .buckets import GradientBuckets, bucket_slots
from .buckets import describe as describe_buckets
from .buckets import enabled as buckets_enabled
from .compression import Compression, Compressor, device_compression
from .sparse import SparseAllreduce

__all__ = ["DistributedOptimizer"]

_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Communicator -> count
_CLASSES: dict = {}
# id(parameter) -> (weak reference to the newest DistributedOptimizer over it, which alone
# reduces its gradient; that optimizer's hook on it). Not an attribute of the parameter,
# which torch.save would then try to pickle; keyed by id, so the per-gradient lookup hashes
# an int rather than a tensor. An entry leaves with its parameter (weakref.finalize).
_OWNERS: dict = {}


# Horovod's warning, which ported scripts may rely on to find the pattern; unlike Horovod,
# ringreduce does not average the gradients a second time there.
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() was called after optimizer.synchronize() without the "
    "`with optimizer.skip_synchronize():` context; wrap step() in it (ringreduce does not "
    "average the gradients twice, but Horovod does, and the code reads as if it should)")


class _Slot:
    """One parameter's state: its name, the passes left before its allreduce starts,
    and that allreduce while it is in flight (``handle is None`` when nothing is).

    The hook of each parameter holds a weak reference to its slot, so the per-gradient
    path looks up no table keyed by tensors (every such lookup runs ``Tensor.__hash__`` in
    Python). Weak, because the slot holds the parameter and the parameter holds the hook
    in torch's C++ storage, where Python's garbage collector cannot see a cycle.
    """

    __slots__ = ("param", "name", "label", "delay", "handle", "grad", "buf", "ctx", "version",
                 "sparse_dim", "stream", "prior", "__weakref__")

    def __init__(self, param: torch.Tensor, name: str, delay: int) -> None:
        self.param, self.name, self.label = param, name, f"gradient of {name!r}"
        self.delay = delay
        self.handle: Any = None
        self.grad: Optional[torch.Tensor] = None
        self.buf: Optional[torch.Tensor] = None  # None with a handle: sparse allreduce
        self.ctx: Any = None
        self.version = 0  # grad._version when its allreduce started
        self.sparse_dim = 0  # > 0: sent dense (sparse_as_dense), to be made sparse again
        self.stream: Optional[int] = None  # a CUDA gradient's producing stream (fast path)
        self.prior: Any = None  # the last stream-ordered allreduce's completion


class _CachedClosure:
    """Stands for the user's closure inside the wrapped step: returns the loss the real
    closure computed before the gradients were averaged; a second evaluation is refused."""

    def __init__(self, loss: Any) -> None:
        self.loss, self.calls = loss, 0

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise InvalidInputError(
                "DistributedOptimizer.step(closure): the wrapped optimizer evaluates the "
                "closure more than once per step (e.g. LBFGS); every evaluation would need "
                "its own gradient allreduce, matched across ranks, which is not supported")
        return self.loss


def _brief(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def _param_names(optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]) -> dict:
    """Map every parameter of ``optimizer`` to a name that is the same on every rank."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"param.{gi}.{pi}" for gi, g in enumerate(optimizer.param_groups)
                for pi, p in enumerate(g["params"])}
    named = list(named_parameters)
    if not all(isinstance(x, tuple) and len(x) == 2 for x in named):
        raise InvalidInputError("DistributedOptimizer: named_parameters must be (name, tensor) "
                                "pairs, e.g. model.named_parameters()")
    counts: dict = {}
    for n, _ in named:
        counts[n] = counts.get(n, 0) + 1
    dups = [n for n, c in counts.items() if c > 1]
    if dups:
        raise InvalidInputError(f"DistributedOptimizer: named_parameters contains duplicate "
                                f"names {_brief(dups)}; every parameter needs a unique name")
    by_param: dict = {}
    for n, p in named:
        by_param.setdefault(p, str(n))
    missing = [p for p in params if p not in by_param]
    if missing:
        shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
        raise InvalidInputError(
            f"DistributedOptimizer: named_parameters does not name {len(missing)} of the "
            f"optimizer's {len(params)} parameters (shapes {shapes}); pass "
            "model.named_parameters() of the model whose parameters the optimizer holds, "
            "or named_parameters=None")
    return {p: by_param[p] for p in params}


def _zero_gradient(p: torch.Tensor, sparse_dims: int) -> torch.Tensor:
    """A zero gradient for ``p``: dense, or sparse COO with no entries and ``sparse_dims``
    sparse dimensions (the layout the ranks that have a gradient reduce)."""
    if not sparse_dims:
        return torch.zeros_like(p, memory_format=torch.contiguous_format)
    return torch.sparse_coo_tensor(torch.empty((sparse_dims, 0), dtype=torch.int64),
                                   torch.empty((0, *p.shape[sparse_dims:]), dtype=p.dtype),
                                   p.shape, check_invariants=True)


def _changed_in_place(inflight: list) -> set:
    """The slots whose dense gradient was changed in place since its allreduce started.

    A gradient that shares its storage, and so its version counter, with other gradients
    (autograd hands them out so for a torch.cat or torch.stack over parameters) changes
    version whenever any of them is accumulated into: those are not judged. Storages are
    looked at only in the rare step where some version moved.
    """
    moved = [s for s in inflight if s.buf is not None and s.grad._version != s.version]
    if not moved:
        return set()
    owners = Counter(s.grad.untyped_storage().data_ptr() for s in inflight
                     if s.buf is not None)
    return {s for s in moved
            if owners[s.grad.untyped_storage().data_ptr()] == 1
            and s.grad.untyped_storage().nbytes() == s.grad.nbytes}


class _DistributedMixin:
    """Methods put in front of the wrapped optimizer's class (see DistributedOptimizer)."""

    def _rr_setup(self, named: dict, compression: type[Compressor], passes: int, op: int,
                  scales: tuple[float, float], sparse_as_dense: bool,
                  process_set: ProcessSet, gradient_buckets: Optional[bool] = None) -> None:
        self._rr_comm: Callable[[], Communicator] = binder(process_set)
        index = instance_index(_INSTANCES, self._rr_comm())
        self._rr_prefix = "grad." if index == 0 else f"grad{index}."
        self._rr_compression = compression
        self._rr_passes = passes
        self._rr_op = op
        self._rr_scale = scales
        self._rr_sparse_as_dense = sparse_as_dense
        self._rr_slots: dict = {}  # parameter -> _Slot
        self._rr_order: list = []  # the slots, sorted by name (the same order on every rank)
        self._rr_inflight: list = []  # slots with an allreduce in flight, in submission order
        self._rr_partial: set = set()  # slots with fewer than k passes accumulated
        self._rr_hooks: list = []
        self._rr_bucket_hooks: list = []  # the buckets' pre-hooks (replaced with the buckets)
        self._rr_orphans: list = []  # CUDA handles of an interrupted step, until done
        self._rr_ref = weakref.ref(self)
        self._rr_synchronized = False
        self._rr_should_sync = True
        self._rr_no_sync = False  # inside no_sync(): backward passes only accumulate
        self._rr_original: Callable[[], Any] = lambda: None
        self._rr_frozen: dict = {}  # parameter -> name, for those without requires_grad
        self._rr_named = named
        self._rr_bucket_flag = gradient_buckets
        self._rr_process_set = process_set
        self._rr_buckets: Optional[GradientBuckets] = None
        self._rr_ready: Callable[[], Optional[Communicator]] = lambda: None
        self._rr_register(named)
        if not in_elastic_job():
            self._rr_collective_setup()
        else:  # the setup waits for TorchState.sync() (elastic_setup): a worker that joins
            # later constructs its optimizer while the others do not
            after_reset(self.elastic_drop)

    def _rr_collective_setup(self) -> None:
        """Agree on the parameters and lay out the gradient buckets on the current
        communicator (collective over the process set; buckets over the whole job)."""
        c, process_set = self._rr_comm(), self._rr_process_set
        agree("DistributedOptimizer", [(s.name, (tuple(s.param.shape), str(s.param.dtype)))
                                       for s in self._rr_order], " on the parameters",
              process_set=process_set)
        params = [p for p in self._rr_named if p in self._rr_slots]  # registration order
        # Buckets are shared_zeros memory, which the whole job allocates together.
        whole_job = process_set is None or process_set.process_set_id == 0
        if whole_job and buckets_enabled(self._rr_bucket_flag,
                                         self._rr_compression is Compression.none, params):
            self._rr_buckets = GradientBuckets(lambda n: c.shared_zeros(n, np.uint8), params)
            self._rr_attach_buckets(params)
        self._rr_ready = weakref.ref(c)

    def elastic_drop(self) -> None:
        """Forget the last generation (local, no communication): its in-flight allreduces,
        partial accumulations and gradient buckets; every ``p.grad`` becomes None.

        Until ``elastic_setup()`` gradients are averaged without buckets. Called after
        every ``ringreduce.elastic.reset()`` in an elastic job; harmless to call twice.
        """
        for s in self._rr_order:
            s.handle = s.grad = s.buf = s.ctx = s.prior = None
            s.stream, s.delay = None, self._rr_passes
            s.param.grad = None
        self._rr_inflight, self._rr_orphans = [], []
        self._rr_partial.clear()
        self._rr_synchronized = False
        for handle in self._rr_bucket_hooks:
            handle.remove()
        self._rr_bucket_hooks = []
        self._rr_buckets = None
        self._rr_ready = lambda: None

    def elastic_setup(self) -> bool:
        """Make this optimizer ready for the current communicator (collective: every rank
        of the new generation calls it at the same point, e.g. in ``TorchState.sync()``).

        If it was set up for an earlier communicator, that generation is forgotten first
        (``elastic_drop``); then the ranks agree on the parameters and the gradient buckets
        are laid out afresh in the new communicator's shared memory. Returns False (and
        does nothing) when it is already set up for the current communicator.
        """
        if self._rr_ready() is self._rr_comm():
            return False
        self.elastic_drop()
        self._rr_collective_setup()
        return True

    def _rr_attach_buckets(self, params: list) -> None:
        ref, owners = self._rr_ref, _OWNERS
        for p in params:
            key = id(p)

            def owned(key: int = key) -> bool:
                return (owners.get(key) or (None,))[0] is ref

            self._rr_bucket_hooks.append(
                p.register_hook(self._rr_buckets.pre_hook(p, owned)))

    def bucket_stats(self) -> dict:
        """The gradient buckets: how many, their bytes, and ``fallbacks``, the gradients
        averaged outside them because the program replaced ``p.grad`` with another tensor."""
        return describe_buckets(self._rr_buckets)

    def _rr_register(self, named: dict) -> None:
        ref = self._rr_ref
        for p, name in named.items():
            if p in self._rr_slots:
                continue
            if not p.requires_grad:  # frozen: registered if it is unfrozen later
                self._rr_frozen[p] = name
                continue
            self._rr_frozen.pop(p, None)
            slot = self._rr_slots[p] = _Slot(p, self._rr_prefix + name, self._rr_passes)
            self._rr_order.append(slot)
            sref = weakref.ref(slot)

            def hook(param: torch.Tensor, ref: Any = ref, sref: Any = sref) -> None:
                opt, s, owner = ref(), sref(), _OWNERS.get(id(param))
                if opt is not None and s is not None and owner is not None and owner[0] is ref:
                    opt._rr_hook(s)

            previous = _OWNERS.get(id(p))
            if previous is not None:
                previous[1].remove()  # an older optimizer's hook: it no longer reduces p
            else:
                weakref.finalize(p, _OWNERS.pop, id(p), None)
            handle = p.register_post_accumulate_grad_hook(hook)
            _OWNERS[id(p)] = (ref, handle)
            self._rr_hooks.append(handle)
        self._rr_order.sort(key=lambda q: q.name)

    # ------------------------------------------------------------ per gradient
    def _rr_hook(self, s: _Slot) -> None:
        if self._rr_buckets is not None:
            self._rr_buckets.adopt(s.param)
        if s.handle is not None:
            raise InvalidInputError(
                f"DistributedOptimizer: the gradient of {s.name!r} was computed "
                f"more than backward_passes_per_step={self._rr_passes} times before step() or "
                "synchronize(); call step() after every backward pass, or pass a larger "
                "backward_passes_per_step to accumulate gradients locally")
        if self._rr_no_sync:  # a pass that does not count towards k (no_sync)
            self._rr_partial.add(s)
            return
        s.delay -= 1
        if s.delay > 0:
            self._rr_partial.add(s)
            return
        if self._rr_partial:
            self._rr_partial.discard(s)
        self._rr_submit(s)

    def _rr_submit(self, s: _Slot) -> None:
        prior, s.prior = s.prior, None
        if prior is not None:
            # The last step's allreduce of this name was waited for on the stream only,
            # and a name is taken until the device has run it: the host, running ahead,
            # waits here (rarely: normally it finished during the forward pass). Its
            # failure (a peer lost after that wait) is raised here.
            prior.wait()
        s.stream = None
        p = s.param
        grad = p.grad
        s.sparse_dim = 0
        if grad.is_sparse and self._rr_sparse_as_dense:
            s.sparse_dim = grad.sparse_dim()
            p.grad = grad = grad.to_dense()
        if self._rr_buckets is not None:
            self._rr_buckets.count_fallback(p, grad)
        if grad.is_sparse:
            s.handle = SparseAllreduce(self._rr_comm(), grad, s.name, self._rr_op,
                                       *self._rr_scale)
            s.grad, s.buf, s.ctx = grad, None, None
        else:
            # CUDA gradients with fp16 / bf16: the GPU executor casts in its fusion kernels.
            wire = device_compression(self._rr_compression, grad)
            buf, ctx = (grad, None) if wire else self._rr_compression.compress(grad)
            c = self._rr_comm()
            if buf is grad and grad.is_cuda:
                s.stream = current_stream(grad)
                s.handle = allreduce_cuda_(c, grad, self._rr_op, s.name, *self._rr_scale,
                                           wire, s.stream)
            if s.handle is None:  # not on the CUDA path
                s.stream = None
                if not buf.is_contiguous() or (buf is grad and not grad.is_contiguous()):
                    buf = buf.contiguous()
                s.handle = c.allreduce_async_(to_numpy(buf, s.label), self._rr_op, s.name,
                                              *self._rr_scale, compression=wire)
            s.grad, s.buf, s.ctx, s.version = grad, buf, ctx, grad._version
        self._rr_inflight.append(s)

    def _rr_finish(self, s: _Slot, changed: bool) -> None:
        handle, grad, buf, ctx = s.handle, s.grad, s.buf, s.ctx
        # The slot keeps the handle until the wait returned: an interrupted wait leaves
        # it to _rr_forget, which keeps the gradient alive until the device is done.
        if s.stream is not None:  # CUDA: the stream waits for the allreduce, not the host
            if wait_cuda_(handle, grad, s.stream):
                s.prior = handle.state  # done once the device has run it: see _rr_submit
            result = None
        else:
            result = handle.wait()
        s.handle = s.grad = s.buf = s.ctx = None
        if changed:
            raise InvalidInputError(
                f"DistributedOptimizer: the gradient of {s.name!r} was changed in place while "
                "it was being averaged (clip_grad_norm_, GradScaler.unscale_ or another in-place "
                "op between backward() and step()?), so ranks would disagree; call "
                "optimizer.synchronize() first, then change the gradients, then step() inside "
                "`with optimizer.skip_synchronize():`")
        if buf is None:  # sparse: the result is a new sparse tensor
            if s.param.grad is grad:
                s.param.grad = result
            return
        if buf is not grad:
            with torch.no_grad():
                grad.copy_(self._rr_compression.decompress(buf, ctx))

    # ---------------------------------------------------------------- public
    def synchronize(self) -> None:
        """Wait until every gradient is averaged across ranks (``p.grad`` then holds it).

        CUDA gradients are waited for as torch DDP waits: the current stream is ordered
        after their allreduces (everything enqueued there next sees the averages) and the
        host goes on without waiting for the device.

        Call it before clipping or unscaling gradients, then run ``step()``
        (inside ``skip_synchronize()`` for Horovod compatibility; a ``step()``
        right after ``synchronize()`` does not communicate again anyway).
        """
        if self._rr_frozen and any(p.requires_grad for p in self._rr_frozen):
            # Unfrozen since (fine-tuning): reduced from now on. This step's gradient
            # came without a hook; the presence count below sends it.
            self._rr_register(dict(self._rr_frozen))
        ref, owners = self._rr_ref, _OWNERS
        slots = [s for s in self._rr_order
                 if (owners.get(id(s.param)) or (None,))[0] is ref]
        try:
            if self._rr_partial:  # partially accumulated (< k passes): send what there is
                for s in slots:
                    if s in self._rr_partial:
                        self._rr_partial.discard(s)
                        self._rr_submit(s)
            counts = self._rr_presence(slots)
            for s, (count, sparse, dims) in zip(slots, counts.T.tolist()):
                if s.handle is not None or count == 0:
                    continue  # sent from the hook, or no rank has a gradient: stays None
                if s.param.grad is None:  # contribute zeros of the kind the others send
                    s.param.grad = self._rr_zeros(s.param, dims // sparse if sparse else 0)
                self._rr_submit(s)
        except BaseException:  # e.g. Ctrl-C in the presence allreduce
            self._rr_forget()
            raise
        self._rr_wait_all()
        self._rr_synchronized = True

    def _rr_zeros(self, p: torch.Tensor, sparse_dims: int) -> torch.Tensor:
        """The zeros a rank without a gradient contributes: its view, if it has one."""
        view = None if sparse_dims or self._rr_buckets is None else \
            self._rr_buckets.views.get(p)
        return view.zero_() if view is not None else _zero_gradient(p, sparse_dims)

    def _rr_presence(self, slots: list) -> np.ndarray:
        """Per parameter (column), summed over the ranks (one small allreduce): row 0, the
        ranks that hold a gradient; row 1, those whose gradient goes as sparse; row 2, their
        gradients' sparse dimensions. A rank without a gradient then sends zeros of the
        same kind (a dense zero against sparse allgathers would never be matched)."""
        has = np.zeros((3, len(slots)), np.int32)
        for i, s in enumerate(slots):
            g = s.grad if s.handle is not None else s.param.grad
            if g is None:
                continue
            has[0, i] = 1
            if g.is_sparse and not self._rr_sparse_as_dense:
                has[1, i], has[2, i] = 1, g.sparse_dim()
        c = self._rr_comm()
        if c.size() == 1:
            return has
        return c.allreduce(has, Sum, f"{self._rr_prefix}present")

    def _rr_wait_all(self) -> None:
        first: Optional[BaseException] = None
        replaced = []
        try:
            inside, rest = bucket_slots(self._rr_buckets, self._rr_inflight)
            changed = _changed_in_place(rest)  # before results are copied back
            if inside:
                changed |= self._rr_buckets.changed(inside)
            for s in self._rr_inflight:
                grad, buf = s.grad, s.buf
                try:
                    self._rr_finish(s, s in changed)
                except Exception as err:
                    first = first or err
                if s.param.grad is not grad and buf is not None:
                    replaced.append(s.name)
                elif s.sparse_dim:  # as Horovod: the optimizer gets the sparse kind back
                    s.param.grad = grad.to_sparse(s.sparse_dim)
        finally:
            self._rr_forget()
        if first is not None:
            raise first
        self._rr_comm().release_done()  # the step's gradients need no keep-alive now
        if replaced:
            raise InvalidInputError(
                f"DistributedOptimizer: the .grad of {_brief(replaced)} was replaced or set to "
                "None between backward() and step() (model.zero_grad() or an assignment?) "
                "while it was being averaged; call zero_grad() before backward() or after "
                "step()")

    def _rr_forget(self) -> None:
        """End the step: drop what is in flight or partial and reset every pass count.
        After an interrupt (KeyboardInterrupt) the engine still completes what was in
        flight, the Communicator (or, for CUDA gradients, ``_rr_orphans``) keeping its
        buffers; the next step's submits of those names wait for CUDA ones (``prior``) and
        may find a host one still in flight if they come within its last milliseconds."""
        orphans = [h for h in self._rr_orphans if not h.done()]
        for s in self._rr_inflight:
            if s.stream is not None and s.handle is not None and not s.handle.done():
                orphans.append(s.handle)  # not waited for: the gradient must outlive it
                s.prior = s.handle.state
            s.handle = s.grad = s.buf = s.ctx = None
        self._rr_orphans = orphans
        self._rr_inflight = []
        self._rr_partial.clear()
        for s in self._rr_order:
            s.delay = self._rr_passes

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (use after ``synchronize()``)."""
        self._rr_should_sync = False
        try:
            yield
        finally:
            self._rr_should_sync = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block only accumulate gradients locally (torch DDP's
        ``no_sync``): the first pass outside it that completes ``backward_passes_per_step``
        starts the allreduces of the accumulated sums, and ``synchronize()``/``step()``
        sends what was accumulated in any case."""
        self._rr_no_sync = True
        try:
            yield
        finally:
            self._rr_no_sync = False

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Synchronize the gradients (unless done already), then step the wrapped optimizer.

        With a ``closure`` (torch's convention): call it with grad enabled to compute
        the loss and gradients, average the gradients, then run the wrapped
        ``step`` with a closure that returns that loss; returns the loss. The
        wrapped optimizer may evaluate the closure only once (not LBFGS: each
        re-evaluation would need its own, matching collectives on every rank).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            closure = _CachedClosure(loss)
        fresh = self._rr_inflight or self._rr_partial
        if self._rr_should_sync and self._rr_synchronized:
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, UserWarning, stacklevel=2)
        if fresh or (self._rr_should_sync and not self._rr_synchronized):
            self.synchronize()  # fresh gradients are averaged even inside skip_synchronize()
        self._rr_synchronized = False
        out = super().step(closure)
        original = self._rr_original()
        if original is not None:  # an LR scheduler made on it before wrapping checks this
            original._opt_called = True
        return loss if closure is not None else out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load like the wrapped optimizer; the original optimizer object keeps sharing the
        (new) state and parameter groups, so LR schedulers made on it keep working."""
        super().load_state_dict(state_dict)
        original = self._rr_original()
        if original is not None and original is not self:
            original.__dict__["state"] = self.state
            original.__dict__["param_groups"] = self.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; raises while an allreduce of one is in flight (between the
        backward() that started it and step()). Gradients only accumulated locally
        (``no_sync()``, or fewer than ``backward_passes_per_step`` passes) are dropped and
        their count starts again, as in one process."""
        busy = [s.name for s in self._rr_inflight]
        if busy:
            raise InvalidInputError(
                f"DistributedOptimizer: zero_grad() was called after backward() but before "
                f"step() or synchronize(), while the gradients of "
                f"{_brief(busy)} are being averaged across ranks; "
                "call zero_grad() before backward() or after step()")
        for slot in self._rr_partial:
            slot.delay = self._rr_passes
        self._rr_partial.clear()
        super().zero_grad(set_to_none=set_to_none)

    def _rr_pending(self) -> bool:
        """Whether a synchronize() is due: gradients in flight or accumulated, or none
        since the last step."""
        return bool(self._rr_inflight or self._rr_partial) or not self._rr_synchronized

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group; its parameters are named ``param.<group>.<index>``."""
        super().add_param_group(param_group)
        if hasattr(self, "_rr_slots"):
            gi = len(self.param_groups) - 1
            self._rr_register({p: f"param.{gi}.{pi}"
                               for pi, p in enumerate(self.param_groups[-1]["params"])})


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Optional[Any] = None,
                         sparse_as_dense: bool = False,
                         gradient_buckets: Optional[bool] = None,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Collective: every rank must wrap an optimizer over the same parameters (in an elastic
    job the collective part waits for ``TorchState.sync()``, see ``elastic_setup``).

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Any optimizer (SGD, Adam, AdamW, custom subclasses, several param groups).
        The result shares its parameter groups, state and hyper-parameters.
    named_parameters : iterable of (str, torch.Tensor), optional
        ``model.named_parameters()``: names the gradients in collectives and error
        messages. Without it parameters are named by position ``param.<group>.<i>``.
    compression : Compressor
        ``Compression.none`` (default), ``Compression.fp16`` or ``Compression.bf16``.
    backward_passes_per_step : int
        Backward passes accumulated locally before the allreduce starts (scale
        the loss by ``1 / backward_passes_per_step`` for an average).
    op : int
        ``Average`` (default), ``Sum``, or ``Adasum``: each rank steps locally and the
        parameter changes are combined with Adasum (Horovod's delta optimizer; see
        ``ringreduce.torch.adasum``).
    gradient_predivide_factor : float
        With Average: divide by this before the sum and by ``size / factor`` after.
    num_groups, groups :
        Horovod's fusion hints, accepted for compatibility and otherwise ignored: the
        engine fuses whichever gradients are ready together by itself.
    sparse_as_dense : bool
        Send sparse gradients (``nn.Embedding(sparse=True)``) as dense tensors;
        otherwise they are allgathered as (indices, values).
    gradient_buckets : bool, optional
        Lay the gradients out as views of one shared bucket per dtype, so backward
        accumulates where the allreduce reads the peers' gradients (``buckets``). Default:
        ``RINGREDUCE_GRADIENT_BUCKETS`` (on unless ``0``); never with compression.
    process_set : ProcessSet
        Average over the members of this set only (called by its members only).

    Returns
    -------
    torch.optim.Optimizer
        An instance of a subclass of ``type(optimizer)`` with ``synchronize()``
        and ``skip_synchronize()``.
    """
    if isinstance(optimizer, (_DistributedMixin, _AdasumMixin)):
        raise InvalidInputError("DistributedOptimizer: this optimizer is already a "
                                "DistributedOptimizer; wrap the plain optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(f"DistributedOptimizer: expected a torch.optim.Optimizer, got "
                                f"{type(optimizer).__name__}")
    what = "DistributedOptimizer"
    check_passes(what, backward_passes_per_step)
    if not isinstance(op, bool) and op == Adasum:  # Horovod's delta optimizer (adasum.py)
        optimizer_scales(what, Average, gradient_predivide_factor, num_groups, groups)
        if gradient_predivide_factor != 1.0:
            raise InvalidInputError(f"{what}: gradient_predivide_factor needs op=Average")
        dist = _swap_class(optimizer, _AdasumMixin)
        dist._rr_adasum_setup(_param_names(optimizer, named_parameters), compression,
                              process_set)
    else:
        scales = optimizer_scales(what, op, gradient_predivide_factor, num_groups, groups,
                                  "ringreduce.torch")
        dist = _swap_class(optimizer, _DistributedMixin)
        dist._rr_setup(_param_names(optimizer, named_parameters), compression,
                       backward_passes_per_step, op, scales, sparse_as_dense, process_set,
                       gradient_buckets)
    dist._rr_original = weakref.ref(optimizer)
    return dist


def _swap_class(optimizer: torch.optim.Optimizer, mixin: type) -> Any:
    """A new instance of a subclass of ``type(optimizer)`` with ``mixin`` in front, sharing
    everything the optimizer holds (param_groups, state, defaults, hooks), but not
    per-instance method overrides such as an LR scheduler's wrapper of the old step()."""
    base = type(optimizer)
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        cls = _CLASSES[(mixin, base)] = type(base.__name__, (mixin, base),
                                             {"__module__": base.__module__})
    dist = cls.__new__(cls)
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                          if k not in ("step", "zero_grad")})
    return dist
