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
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np
import torch

from ringreduce import Average, Communicator, Sum
from ringreduce.exceptions import InvalidInputError

from ._tensors import binder, to_numpy
from .broadcast import agree
from .compression import Compression, Compressor
from .sparse import SparseAllreduce

__all__ = ["DistributedOptimizer"]

_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Communicator -> count
_CLASSES: dict = {}


class _Pending:
    """One gradient's allreduce in flight."""

    __slots__ = ("handle", "grad", "buf", "ctx")

    def __init__(self, handle: Any, grad: torch.Tensor, buf: torch.Tensor, ctx: Any) -> None:
        self.handle, self.grad, self.buf, self.ctx = handle, grad, buf, ctx


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


class _DistributedMixin:
    """Methods put in front of the wrapped optimizer's class (see DistributedOptimizer)."""

    def _rr_setup(self, named: dict, compression: type[Compressor], passes: int, op: int,
                  predivide: float, sparse_as_dense: bool) -> None:
        self._rr_comm: Callable[[], Communicator] = binder()
        c = self._rr_comm()
        index = _INSTANCES.get(c, 0)
        _INSTANCES[c] = index + 1
        self._rr_prefix = "grad." if index == 0 else f"grad{index}."
        self._rr_compression = compression
        self._rr_passes = passes
        self._rr_op = op
        self._rr_scale = (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
        self._rr_sparse_as_dense = sparse_as_dense
        self._rr_names: dict = {}
        self._rr_params: list = []
        self._rr_delay: dict = {}
        self._rr_pending: dict = {}
        self._rr_partial: set = set()
        self._rr_hooks: list = []
        self._rr_ref = weakref.ref(self)
        self._rr_synchronized = False
        self._rr_should_sync = True
        self._rr_original: Callable[[], Any] = lambda: None
        self._rr_register(named)
        agree("DistributedOptimizer", [(self._rr_names[p], (tuple(p.shape), str(p.dtype)))
                                       for p in self._rr_params], " on the parameters")

    def _rr_register(self, named: dict) -> None:
        ref = self._rr_ref
        for p, name in named.items():
            if p in self._rr_names or not p.requires_grad:
                continue
            self._rr_names[p] = self._rr_prefix + name
            self._rr_params.append(p)
            self._rr_delay[p] = self._rr_passes
            p._rr_owner = ref  # the newest DistributedOptimizer over p reduces its gradient

            def hook(param: torch.Tensor, ref: Any = ref) -> None:
                opt = ref()
                if opt is not None and getattr(param, "_rr_owner", None) is ref:
                    opt._rr_hook(param)

            self._rr_hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._rr_params.sort(key=lambda q: self._rr_names[q])

    # ------------------------------------------------------------ per gradient
    # Once per gradient: each dict lookup hashes a tensor through Python
    # (Tensor.__hash__), so the hook looks each table up once.
    def _rr_hook(self, p: torch.Tensor) -> None:
        name = self._rr_names.get(p)
        if name is None:
            return
        if p in self._rr_pending:
            raise InvalidInputError(
                f"DistributedOptimizer: the gradient of {name!r} was computed "
                f"more than backward_passes_per_step={self._rr_passes} times before step() or "
                "synchronize(); call step() after every backward pass, or pass a larger "
                "backward_passes_per_step to accumulate gradients locally")
        delay = self._rr_delay[p] - 1
        self._rr_delay[p] = delay
        if delay > 0:
            self._rr_partial.add(p)
            return
        if self._rr_partial:
            self._rr_partial.discard(p)
        self._rr_submit(p, name)

    def _rr_submit(self, p: torch.Tensor, name: Optional[str] = None) -> None:
        name, grad = name or self._rr_names[p], p.grad
        c = self._rr_comm()
        if grad.is_sparse and self._rr_sparse_as_dense:
            p.grad = grad = grad.to_dense()
        if grad.is_sparse:
            self._rr_pending[p] = _Pending(SparseAllreduce(c, grad, name, self._rr_op,
                                                           *self._rr_scale), grad, None, None)
            return
        buf, ctx = self._rr_compression.compress(grad)
        if not buf.is_contiguous() or (buf is grad and not grad.is_contiguous()):
            buf = buf.contiguous()
        handle = c.allreduce_async_(to_numpy(buf, f"gradient of {name!r}"), self._rr_op, name,
                                    *self._rr_scale)
        self._rr_pending[p] = _Pending(handle, grad, buf, ctx)

    def _rr_finish(self, p: torch.Tensor, pend: _Pending) -> None:
        result = pend.handle.wait()
        if pend.buf is None:  # sparse: the result is a new sparse tensor
            if p.grad is pend.grad:
                p.grad = result
            return
        if pend.buf is not pend.grad:
            with torch.no_grad():
                pend.grad.copy_(self._rr_compression.decompress(pend.buf, pend.ctx))

    # ---------------------------------------------------------------- public
    def synchronize(self) -> None:
        """Wait until every gradient is averaged across ranks (``p.grad`` then holds it).

        Call it before clipping or unscaling gradients, then run ``step()``
        (inside ``skip_synchronize()`` for Horovod compatibility; a ``step()``
        right after ``synchronize()`` does not communicate again anyway).
        """
        params = [p for p in self._rr_params if getattr(p, "_rr_owner", None) is self._rr_ref]
        if self._rr_partial:  # partially accumulated (fewer than k passes): send what there is
            for p in params:
                if p in self._rr_partial:
                    self._rr_partial.discard(p)
                    self._rr_submit(p)
        counts = self._rr_presence(params)
        for p, count in zip(params, counts):
            if p in self._rr_pending or count == 0:
                continue  # sent from the hook, or no rank has a gradient: stays None
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            self._rr_submit(p)
        self._rr_wait_all()
        self._rr_synchronized = True

    def _rr_presence(self, params: list) -> np.ndarray:
        """How many ranks hold a gradient for each parameter (one small Sum allreduce)."""
        has = np.array([p in self._rr_pending or p.grad is not None for p in params], np.int32)
        c = self._rr_comm()
        if c.size() == 1:
            return has
        return c.allreduce(has, Sum, f"{self._rr_prefix}present")

    def _rr_wait_all(self) -> None:
        pending, self._rr_pending = self._rr_pending, {}
        first: Optional[BaseException] = None
        replaced = []
        for p, pend in pending.items():
            try:
                self._rr_finish(p, pend)
            except Exception as err:
                first = first or err
            if p.grad is not pend.grad and pend.buf is not None:
                replaced.append(self._rr_names[p])
        # dict.fromkeys over a dict reuses the stored hashes: no Tensor.__hash__ per parameter.
        self._rr_delay = dict.fromkeys(self._rr_delay, self._rr_passes)
        if first is not None:
            raise first
        if replaced:
            raise InvalidInputError(
                f"DistributedOptimizer: the .grad of {_brief(replaced)} was replaced or set to "
                "None between backward() and step() (model.zero_grad() or an assignment?) "
                "while it was being averaged; call zero_grad() before backward() or after "
                "step()")

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (use after ``synchronize()``)."""
        self._rr_should_sync = False
        try:
            yield
        finally:
            self._rr_should_sync = True

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
        fresh = self._rr_pending or self._rr_partial
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
        """Reset gradients; raises if called between backward() and step()."""
        busy = list(self._rr_pending) + list(self._rr_partial)
        if busy:
            raise InvalidInputError(
                f"DistributedOptimizer: zero_grad() was called after backward() but before "
                f"step() or synchronize(), while the gradients of "
                f"{_brief(self._rr_names[p] for p in busy)} are being averaged across ranks; "
                "call zero_grad() before backward() or after step()")
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group; its parameters are named ``param.<group>.<index>``."""
        super().add_param_group(param_group)
        if hasattr(self, "_rr_names"):
            gi = len(self.param_groups) - 1
            self._rr_register({p: f"param.{gi}.{pi}"
                               for pi, p in enumerate(self.param_groups[-1]["params"])})


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Optional[Any] = None,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Collective: every rank must wrap an optimizer over the same parameters.

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
        ``Average`` (default) or ``Sum``.
    gradient_predivide_factor : float
        With Average: divide by this before the sum and by ``size / factor`` after.
    num_groups, groups :
        Horovod's fusion hints, accepted for compatibility and otherwise ignored: the
        engine fuses whichever gradients are ready together by itself.
    sparse_as_dense : bool
        Send sparse gradients (``nn.Embedding(sparse=True)``) as dense tensors;
        otherwise they are allgathered as (indices, values).

    Returns
    -------
    torch.optim.Optimizer
        An instance of a subclass of ``type(optimizer)`` with ``synchronize()``
        and ``skip_synchronize()``.
    """
    if isinstance(optimizer, _DistributedMixin):
        raise InvalidInputError("DistributedOptimizer: this optimizer is already a "
                                "DistributedOptimizer; wrap the plain optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(f"DistributedOptimizer: expected a torch.optim.Optimizer, got "
                                f"{type(optimizer).__name__}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise InvalidInputError(f"DistributedOptimizer: backward_passes_per_step must be an int "
                                f">= 1, got {backward_passes_per_step!r}")
    if op not in (Average, Sum):
        raise InvalidInputError("DistributedOptimizer: op must be ringreduce.torch.Average or "
                                f"Sum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidInputError("DistributedOptimizer: gradient_predivide_factor needs "
                                "op=Average")
    if not gradient_predivide_factor > 0:
        raise InvalidInputError("DistributedOptimizer: gradient_predivide_factor must be > 0")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise InvalidInputError(f"DistributedOptimizer: num_groups must be an int >= 0, got "
                                f"{num_groups!r}")
    if groups is not None and not isinstance(groups, (int, list, tuple)):
        raise InvalidInputError("DistributedOptimizer: groups must be None, an int or a list "
                                f"of lists of parameters, got {type(groups).__name__}")
    named = _param_names(optimizer, named_parameters)
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedMixin, base),
                                    {"__module__": base.__module__})
    dist = cls.__new__(cls)
    # Share everything the optimizer holds (param_groups, state, defaults, hooks), but not
    # per-instance method overrides such as an LR scheduler's wrapper of the old step().
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                          if k not in ("step", "zero_grad")})
    dist._rr_setup(named, compression, backward_passes_per_step, op,
                   float(gradient_predivide_factor), sparse_as_dense)
    dist._rr_original = weakref.ref(optimizer)
    return dist
