"""SyncBatchNorm: batch normalization whose batch statistics span every rank's batch.

In training mode the per-channel mean and variance are computed over the union
of all ranks' batches (two Sum allreduces: the sums, then the centred squares,
which is exact and numerically stable), so ``-np N`` with per-rank batch B/N
normalizes like one process with batch B. The backward pass is derived by
autograd through the differentiable allreduce, which is exactly the
cross-rank gradient of the global batch statistics. In eval mode, or with a
single rank, it is ordinary batch normalization with the running statistics.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ringreduce import Sum
from ringreduce.exceptions import InvalidInputError

from ._tensors import comm
from .ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over all ranks' batches; a drop-in for ``nn.BatchNorm{1,2,3}d``.

    Parameters
    ----------
    num_features : int
        Number of channels C of inputs shaped (N, C, ...).
    eps, momentum, affine, track_running_stats :
        As for ``torch.nn.BatchNorm2d``.

    Notes
    -----
    In training mode the forward pass is collective: every rank must call it
    (a rank may pass an empty batch, but the total over ranks must be > 1).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise InvalidInputError(f"SyncBatchNorm: expected an input of shape (N, C, ...), "
                                    f"got {input.dim()}-d {tuple(input.shape)}")

    def _momentum(self) -> float:
        """The running-average factor, as ``_BatchNorm.forward`` computes it."""
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with statistics over all ranks (training) or running ones."""
        self._check_input_dim(input)
        if not self.training or comm().size() == 1:
            return super().forward(input)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        shape = [1, c] + [1] * (input.dim() - 2)
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        local = torch.cat([x.sum(dims), x.new_full((1,), input.numel() // max(c, 1))])
        totals = allreduce(local, op=Sum)
        count = totals[c].detach()
        if float(count) < 2:
            raise InvalidInputError(f"SyncBatchNorm: the batches of all ranks hold {int(count)} "
                                    "value(s) per channel; training needs at least 2")
        mean = totals[:c] / count
        centred = x - mean.view(shape)
        var = allreduce((centred * centred).sum(dims), op=Sum) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                m = self._momentum()
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        return y.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` replaced by a SyncBatchNorm.

        Parameters and running statistics are carried over (shared, not copied).
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out

