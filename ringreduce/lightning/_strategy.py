"""The Lightning strategy, built once per Lightning package (``lightning.pytorch`` or
``pytorch_lightning``: each has its own ``Strategy`` and registry, so a class made for one
is refused by the other's ``Trainer``).

How a step runs (automatic optimization, ``accumulate_grad_batches=k``)::

    batch 1..k-1: closure()                 forward, loss / k, backward: each gradient's
                                            hook counts down (backward_passes_per_step=k)
    batch k:      optimizer_step(closure)   the closure we pass down runs forward and
                                            backward (the hooks start the allreduces),
                                            then synchronize() waits for the averages;
                  precision plugin          on_before_optimizer_step, gradient clipping
                                            and unscaling see the averaged gradients
                  optimizer.step()          inside skip_synchronize(): no second average

Invariants: every rank runs the same number of ``optimizer_step`` calls per epoch (the
``DistributedSampler`` Lightning puts in gives each rank ``ceil(len / size)`` samples);
parameters and optimizer state leave ``setup`` equal on every rank (broadcast from rank 0).
(A ``training_step`` that returns None is refused by Lightning itself in distributed
training, on the rank that does it; the others then raise ``PeerLostError`` naming it.)
"""

from __future__ import annotations

import importlib
import os
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

import ringreduce as rr
import ringreduce.torch as rrt
from ringreduce.exceptions import InvalidInputError

_OPS = {"mean": rr.Average, "avg": rr.Average, "average": rr.Average, "sum": rr.Sum,
        "max": rr.Max, "min": rr.Min, "product": rr.Product, "prod": rr.Product}


def ring_op(op: Any) -> int:
    """ringreduce's op for Lightning's ``reduce_op`` (None, a string or ``ReduceOp``)."""
    if op is None:
        return rr.Average
    key = op if isinstance(op, str) else getattr(op, "name", str(op))
    found = _OPS.get(str(key).lower().rsplit(".", 1)[-1])
    if found is None:
        raise InvalidInputError(
            f"rank {rr.rank()}: RingreduceStrategy.reduce: unsupported reduce_op {op!r}; use "
            f"one of {sorted(_OPS)} or torch.distributed.ReduceOp.SUM/AVG/MAX/MIN/PRODUCT")
    return found


def _no_group(group: Any, what: str, world: Any = None) -> None:
    if group is not None and group is not world:
        raise InvalidInputError(
            f"rank {rr.rank()}: RingreduceStrategy.{what}: process groups are torch.distributed's "
            "and ringreduce does not use them; leave group unset (every rank takes part)")


class _GatherFn(torch.autograd.Function):
    """Stack every rank's tensor; the gradient of a rank's slice is the sum of the slice's
    gradients on all ranks (torch.distributed.nn.all_gather's rule, which Lightning's
    ``all_gather(sync_grads=True)`` uses under DDP)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return rrt.allgather(tensor.detach().unsqueeze(0).contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return rrt.allreduce(grad.contiguous(), op=rr.Sum)[rr.rank()]


def gather_all_tensors(result: torch.Tensor, group: Any = None) -> list:
    """Every rank's ``result`` (shapes may differ in size, not in rank), in rank order:
    torchmetrics' ``dist_sync_fn`` over ringreduce instead of ``torch.distributed``."""
    _no_group(group, "gather_all_tensors", _world_group())
    t = result.detach().contiguous()
    t = t.reshape(1) if t.dim() == 0 else t
    shape = torch.tensor(t.shape, dtype=torch.int64)
    shapes = rrt.allgather(shape.unsqueeze(0)).tolist()  # raises if the ranks differ
    flat = rrt.allgather(t.reshape(-1))
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    parts = torch.split(flat, sizes)
    return [p.reshape(s if result.dim() else ()) for p, s in zip(parts, shapes)]


def _sync_metrics(module: torch.nn.Module) -> int:
    """Point the torchmetrics ``Metric``s in ``module`` (those left at torchmetrics'
    defaults) at ringreduce: they would otherwise find no ``torch.distributed`` group and
    compute on this rank's data alone, silently. Returns how many."""
    import sys

    if "torchmetrics" not in sys.modules:
        return 0
    from torchmetrics import Metric
    from torchmetrics.utilities.distributed import gather_all_tensors as torch_gather

    count = 0
    for m in module.modules():
        if isinstance(m, Metric) and m.dist_sync_fn in (None, torch_gather):
            m.dist_sync_fn = gather_all_tensors
            m.distributed_available_fn = _several_ranks
            count += 1
    return count


def _several_ranks() -> bool:
    return rr.size() > 1


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's optimizer


def _named(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """The module's named parameters that ``optimizer`` updates, in the module's order."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in module.named_parameters() if id(p) in mine]


def started(env_cls: type) -> Any:
    """``ringreduce.init()`` unless done (as Lightning 1.x's Horovod strategy did), then a
    RingreduceEnvironment."""
    if not rr.is_initialized():
        rr.init()
    return env_cls()


def _set_rank_zero(rank: int) -> None:
    """Lightning reads the rank from RANK/SLURM_PROCID at import; mpirun sets neither."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = rank


def _accumulation(trainer: Any) -> int:
    for cb in trainer.callbacks:
        if type(cb).__name__ == "GradientAccumulationScheduler":
            raise InvalidInputError(
                f"rank {rr.rank()}: RingreduceStrategy: GradientAccumulationScheduler changes "
                "accumulate_grad_batches between epochs, and DistributedOptimizer's "
                "backward_passes_per_step is fixed; use Trainer(accumulate_grad_batches=k)")
    return int(trainer.accumulate_grad_batches)


def _environment_class(package: str) -> type:
    """RingreduceEnvironment on ``package``'s ClusterEnvironment (a Trainer's or Fabric's)."""
    base = importlib.import_module(package + ".plugins.environments").ClusterEnvironment

    class RingreduceEnvironment(base):
        """Lightning's view of a ringreduce job: ranks come from ``ringreduce.init()``;
        processes are started outside Lightning (mpirun, ringrun, Spark, Ray)."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return os.environ.get("MASTER_ADDR", "127.0.0.1")

        @property
        def main_port(self) -> int:
            return int(os.environ.get("MASTER_PORT", "0"))

        @staticmethod
        def detect() -> bool:
            return rr.is_initialized()

        def world_size(self) -> int:
            return rr.size()

        def set_world_size(self, size: int) -> None:
            pass  # fixed by the launcher

        def global_rank(self) -> int:
            return rr.rank()

        def set_global_rank(self, rank: int) -> None:
            pass  # fixed by the launcher

        def local_rank(self) -> int:
            return rr.local_rank()

        def node_rank(self) -> int:
            return rr.cross_rank()

    return RingreduceEnvironment


class Collectives:
    """What both of ringreduce's Lightning strategies (the Trainer's and Fabric's) answer
    the same way: the device of a rank and the collectives Lightning asks for."""

    @property
    def root_device(self) -> torch.device:
        kind = self.parallel_devices[0].type if self.parallel_devices else "cpu"
        if kind == "cuda":  # one process per GPU, as Horovod: this host's rank picks it
            return torch.device("cuda", rr.local_rank() % max(torch.cuda.device_count(), 1))
        return torch.device(kind)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": rr.size(), "rank": rr.rank()}

    def setup_environment(self) -> None:
        """Refuse ``devices=N`` in a process that no launcher started: DDP would start N
        processes there, this strategy starts none. (Under a launcher each rank takes the
        device of its local rank, whatever ``devices`` lists, as Horovod's did.)"""
        count = len(self.parallel_devices or [])
        if count > 1 and rr.size() == 1:
            raise InvalidInputError(
                f"rank {rr.rank()}: {type(self).__name__}: devices={count} in a job of one "
                "process: Lightning starts no processes for this strategy. Start one per "
                "device with a launcher (mpirun -np N, ringrun -np N, Spark, Ray), or "
                "keep devices=1 to train alone")
        super().setup_environment()

    def module_to_device(self, module: torch.nn.Module) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        module.to(self.root_device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Allreduce ``tensor`` over every rank (a non-tensor comes back unchanged)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        _no_group(group, "reduce")
        op = ring_op(reduce_op)
        if op == rr.Average and not tensor.is_floating_point():
            tensor = tensor.double()  # Lightning's DDP: a mean of ints is not rounded
        return rrt.allreduce(tensor.contiguous(), op=op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension of ``size()``."""
        _no_group(group, "all_gather", _world_group())
        if sync_grads:
            return _GatherFn.apply(tensor)
        return rrt.allgather(tensor.detach().unsqueeze(0).contiguous())

    def barrier(self, name: Optional[str] = None) -> None:
        rr.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return rrt.broadcast_object(obj, root_rank=src)

    def _options(self, **optimizer_options: Any) -> None:
        """The DistributedOptimizer options; the rank Lightning prints from."""
        self._opt_kwargs = optimizer_options
        self._exit_stack: Optional[ExitStack] = None
        _set_rank_zero(rr.rank())

    def _wrap(self, optimizer: Any, named: list, passes: int = 1) -> Any:
        """``optimizer`` as a DistributedOptimizer (one already is stays), its state
        broadcast from rank 0, held in skip_synchronize() until teardown."""
        rrt.broadcast_optimizer_state(optimizer, root_rank=0)
        if not hasattr(optimizer, "skip_synchronize"):
            optimizer = rrt.DistributedOptimizer(optimizer, named_parameters=named,
                                                 backward_passes_per_step=passes,
                                                 **self._opt_kwargs)
        if self._exit_stack is None:
            self._exit_stack = ExitStack()
        self._exit_stack.enter_context(optimizer.skip_synchronize())
        return optimizer

    def _release(self) -> None:
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None


class StrategyMethods(Collectives):
    """What RingreduceStrategy adds to Lightning's ParallelStrategy (in front of it)."""

    @property
    def is_distributed(self) -> bool:  # Lightning then puts in a DistributedSampler
        return True

    def model_to_device(self) -> None:
        self.module_to_device(self.model)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        rrt.broadcast_parameters(module.state_dict(), root_rank=0)
        _sync_metrics(module)
        if trainer.state.fn != self._fitting:
            return
        passes = _accumulation(trainer)
        optimizers = [_unwrap(o) for o in self.optimizers]
        if self._scale_lr:
            _scale_rates(optimizers, self.lr_scheduler_configs)
        # synchronized by the closure (see optimizer_step)
        self.optimizers = [self._wrap(o, _named(module, o), passes) for o in optimizers]
        _clip_after_synchronize(self.precision_plugin)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Manual optimization: Lightning cannot tell which ``manual_backward`` passes
        precede a step (accumulation, a GAN's losses reaching both models), so every pass
        only accumulates (``no_sync()``) and ``opt.step()`` averages what it holds."""
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with ExitStack() as stack:
            for opt in self.optimizers:
                inner = _unwrap(opt)
                if hasattr(inner, "no_sync"):
                    stack.enter_context(inner.no_sync())
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, _synchronizing(optimizer, closure), model,
                                      **kwargs)

    def teardown(self) -> None:
        self._release()
        super().teardown()


def _scale_rates(optimizers: list, scheduler_configs: list) -> None:
    """Lightning 1.x's Horovod strategy: every rate, and each scheduler's base rates,
    times the number of ranks."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] *= rr.size()
    for config in scheduler_configs:
        if hasattr(config.scheduler, "base_lrs"):
            config.scheduler.base_lrs = [lr * rr.size() for lr in config.scheduler.base_lrs]


def _world_group() -> Any:
    dist = torch.distributed
    return dist.group.WORLD if dist.is_available() else None


def build(package: str) -> SimpleNamespace:
    """RingreduceEnvironment, RingreduceStrategy and HorovodStrategy for one Lightning
    package, registered in its ``StrategyRegistry`` as "ringreduce" and "horovod", and
    RingreduceFabricStrategy for its Fabric, registered there as "ringreduce"."""
    strategies = importlib.import_module(package + ".strategies")
    trainer_fn = importlib.import_module(package + ".trainer.states").TrainerFn
    env_cls = _environment_class(package)
    strategy_cls = _strategy_class(strategies.ParallelStrategy, env_cls, trainer_fn)

    class HorovodStrategy(strategy_cls):
        """``Trainer(strategy="horovod")`` of PyTorch Lightning 1.x: as RingreduceStrategy,
        with each learning rate (and each scheduler's base rate) multiplied by the number
        of ranks, as Lightning's Horovod strategy did."""

        strategy_name = "horovod"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("scale_lr", True)
            super().__init__(*args, **kwargs)

    for cls in (strategy_cls, HorovodStrategy):
        strategies.StrategyRegistry.register(cls.strategy_name, cls, description=cls.__doc__,
                                             override=True)
    from ._fabric import build_fabric

    fabric = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}
    return SimpleNamespace(RingreduceEnvironment=env_cls, RingreduceStrategy=strategy_cls,
                           HorovodStrategy=HorovodStrategy,
                           RingreduceFabricStrategy=build_fabric(fabric[package]))


def _strategy_class(parallel: type, env_cls: type, trainer_fn: Any) -> type:
    class RingreduceStrategy(StrategyMethods, parallel):
        """Data-parallel training over ringreduce: one process per device, started by
        mpirun, ``ringrun``, Spark or Ray; gradients averaged by ringreduce's
        ``DistributedOptimizer`` (see the module docstring for one step's order)."""

        strategy_name = "ringreduce"

        def __init__(self, accelerator: Any = None,
                     parallel_devices: Optional[list] = None, checkpoint_io: Any = None,
                     precision_plugin: Any = None, *, scale_lr: bool = False,
                     compression: Any = rrt.Compression.none,
                     gradient_predivide_factor: float = 1.0, op: int = rr.Average,
                     sparse_as_dense: bool = False) -> None:
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=started(env_cls),
                             checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
            self._scale_lr = bool(scale_lr)
            self._fitting = trainer_fn.FITTING
            self._options(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                          gradient_predivide_factor=gradient_predivide_factor)

    return RingreduceStrategy


def synchronize_pending(optimizer: Any) -> None:
    """Wait for ``optimizer``'s averaged gradients unless that is done since the last
    backward pass (a clip then the step synchronize once)."""
    inner = _unwrap(optimizer)
    if getattr(inner, "_rr_pending", lambda: False)():
        inner.synchronize()


def _synchronizing(optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """``closure``, then wait for the averaged gradients (before clipping and the step)."""

    def run() -> Any:
        result = closure()
        synchronize_pending(optimizer)
        return result

    return run


def _clip_after_synchronize(plugin: Any) -> None:
    """Make the precision plugin's clip_gradients wait for the averages first: a manual
    ``self.clip_gradients(opt, ...)`` before ``opt.step()`` clips what is stepped on."""
    if getattr(plugin, "_rr_clips_averages", False):
        return
    clip = plugin.clip_gradients

    def clip_gradients(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        synchronize_pending(optimizer)
        return clip(optimizer, *args, **kwargs)

    plugin.clip_gradients = clip_gradients
    plugin._rr_clips_averages = True
