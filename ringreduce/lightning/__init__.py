"""ringreduce for PyTorch Lightning: a ``Strategy`` for ``Trainer``.

::

    import lightning.pytorch as pl        # or: import pytorch_lightning as pl
    import ringreduce.lightning            # registers "ringreduce" and "horovod"

    trainer = pl.Trainer(strategy="ringreduce", max_epochs=5)   # mpirun -np 4 python train.py
    trainer.fit(model, train_loader)

``RingreduceStrategy`` trains as Lightning's DDP does (a ``DistributedSampler`` per rank,
gradients averaged before clipping and the step, ``self.log(..., sync_dist=True)``,
checkpoints written by rank 0); ``HorovodStrategy`` (``strategy="horovod"``) is PyTorch
Lightning 1.x's Horovod strategy, which also multiplied the learning rates by the number of
ranks. The classes here are made for ``lightning.pytorch`` when it is installed (else for
``pytorch_lightning``); ``for_package("pytorch_lightning")`` gives the other package's.
``RingreduceFabricStrategy`` (``Fabric(strategy="ringreduce")``) is the same for Lightning
Fabric's loops.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

from ._strategy import build, gather_all_tensors

_BUILT: dict[str, SimpleNamespace] = {}


def for_package(package: str) -> SimpleNamespace:
    """The strategy classes for ``package`` ("lightning.pytorch" or "pytorch_lightning").

    Returns
    -------
    SimpleNamespace
        ``RingreduceEnvironment``, ``RingreduceStrategy`` and ``HorovodStrategy``, registered
        in that package's ``StrategyRegistry`` as "ringreduce" and "horovod", and
        ``RingreduceFabricStrategy``, registered in its Fabric's as "ringreduce".
    """
    if package not in _BUILT:
        _BUILT[package] = build(package)
    return _BUILT[package]


def _default_package() -> str:
    if importlib.util.find_spec("lightning") is not None:
        return "lightning.pytorch"
    if importlib.util.find_spec("pytorch_lightning") is not None:
        return "pytorch_lightning"
    raise ImportError("ringreduce.lightning needs PyTorch Lightning: pip install "
                      "'ringreduce[lightning]' (or lightning / pytorch_lightning >= 2.6)")


_classes = for_package(_default_package())
for _other in ("pytorch_lightning", "lightning.pytorch"):
    # the strings work in whichever package the script's Trainer comes from
    if _other not in _BUILT and importlib.util.find_spec(_other.split(".")[0]) is not None:
        for_package(_other)
RingreduceEnvironment = _classes.RingreduceEnvironment
RingreduceStrategy = _classes.RingreduceStrategy
HorovodStrategy = _classes.HorovodStrategy
RingreduceFabricStrategy = _classes.RingreduceFabricStrategy

__all__ = ["HorovodStrategy", "RingreduceEnvironment", "RingreduceFabricStrategy",
           "RingreduceStrategy", "for_package", "gather_all_tensors"]
