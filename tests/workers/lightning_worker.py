"""PyTorch Lightning's Trainer with ringreduce's strategy, in real processes.

    RINGREDUCE_RANK=r RINGREDUCE_SIZE=2 ... python lightning_worker.py DIR   (r = 0, 1)

np=2 with Lightning's DistributedSampler ends with the weights of one process training on
the union of the ranks' batches (SGD with momentum; accumulate_grad_batches=2 with gradient
clipping, which must see the averaged gradients; HorovodStrategy's scaled learning rate;
manual optimization; "horovod" through pytorch_lightning's registry), and float16
autocast with a GradScaler near it; Lightning Fabric's own loop with no_backward_sync and
clip_gradients on it too. Then sync_dist
logging, an EarlyStopping decision taken on one rank only, ModelCheckpoint on rank 0,
all_gather (with sync_grads), validate/test, and the refusals. Last, rank 1 exits inside
fit and rank 0 must raise from fit within seconds. The env-var launch, since mpirun would
kill rank 0 as soon as rank 1 exits.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from workerlib import error_event, event, run, say, set_rank

import ringreduce.lightning as rl
import ringreduce.torch as rrt
from ringreduce.exceptions import InvalidInputError

warnings.filterwarnings("ignore")  # Lightning's advice on num_workers, logging intervals...
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 5, generator=G), torch.randn(48, 2, generator=G)
B, LR = 4, 0.1
QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False,
         "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}


def network() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


class Steps:
    """The model's steps, for lightning.pytorch's and pytorch_lightning's LightningModule."""

    def __init__(self, manual: bool = False, lr: float = LR) -> None:
        super().__init__()
        self.net, self.lr = network(), lr
        self.automatic_optimization = not manual

    def training_step(self, batch: tuple, idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Model(Steps, pl.LightningModule):
    pass


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def reference(epochs: int, k: int, clip: float | None, lr: float) -> torch.Tensor:
    """One process on the union of the ranks' batches. Lightning's DistributedSampler
    shuffles a training set with seed 0 + epoch; rank r takes perm[r::2], so batch b of
    the two ranks together holds perm[2bB : 2bB + 2B]."""
    net = network()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(epoch))
        steps = len(X) // (2 * B)
        for i in range(steps):
            rows = perm[2 * B * i:2 * B * (i + 1)]
            (torch.nn.functional.mse_loss(net(X[rows]), Y[rows]) / k).backward()
            if (i + 1) % k == 0 or i + 1 == steps:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                opt.step()
                opt.zero_grad()
    return flat(net)


def equivalence(name: str, strategy: object, k: int = 1, clip: float | None = None,
                manual: bool = False, package: object = pl) -> None:
    model = (Model if package is pl else type("Model", (Steps, package.LightningModule), {}))(
        manual=manual)
    trainer = package.Trainer(strategy=strategy, max_epochs=2, accumulate_grad_batches=k,
                          gradient_clip_val=clip, **QUIET)
    trainer.fit(model, DataLoader(TensorDataset(X, Y), batch_size=B))
    scaled = trainer.optimizers[0].param_groups[0]["lr"]
    got = flat(model.net)
    spread = (rrt.allreduce(got, op=rrt.Max) - rrt.allreduce(got, op=rrt.Min)).abs().max()
    event("equivalence", case=name, diff=float((got - reference(2, k, clip, scaled)).abs().max()),
          spread=float(spread), lr=scaled, steps=trainer.global_step,
          optimizer=type(trainer.optimizers[0]).__name__,
          distributed=hasattr(trainer.optimizers[0], "synchronize"))


class ManualAccumulation(Model):
    """Lightning's manual accumulation and clipping: manual_backward every batch, then
    clip_gradients and step every second one."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch: tuple, idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y) / 2)
        if idx % 2:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


class TwoOptimizers(pl.LightningModule):
    """A GAN's shape without toggle_optimizer: g's loss flows through d's parameters too,
    whose gradients d's zero_grad() then drops."""

    def __init__(self) -> None:
        super().__init__()
        self.g, self.d = two_nets()
        self.automatic_optimization = False

    def training_step(self, batch: tuple, idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        x = batch[0]
        g_opt.zero_grad()
        self.manual_backward(-self.d(self.g(x)).mean())
        g_opt.step()
        d_opt.zero_grad()
        self.manual_backward(self.d(self.g(x).detach()).mean() - self.d(x).mean())
        d_opt.step()

    def configure_optimizers(self) -> list:
        return [torch.optim.SGD(self.g.parameters(), lr=LR),
                torch.optim.SGD(self.d.parameters(), lr=LR)]


def two_nets() -> tuple:
    torch.manual_seed(7)
    return torch.nn.Linear(5, 5), torch.nn.Linear(5, 1)


def two_nets_reference() -> torch.Tensor:
    """TwoOptimizers in one process on the union of the ranks' batches (1 epoch)."""
    g, d = two_nets()
    g_opt, d_opt = torch.optim.SGD(g.parameters(), lr=LR), torch.optim.SGD(d.parameters(), lr=LR)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    for i in range(len(X) // (2 * B)):
        x = X[perm[2 * B * i:2 * B * (i + 1)]]
        g_opt.zero_grad()
        (-d(g(x)).mean()).backward()
        g_opt.step()
        d_opt.zero_grad()
        (d(g(x).detach()).mean() - d(x).mean()).backward()
        d_opt.step()
    return torch.cat([flat(g), flat(d)])


def manual_patterns() -> None:
    accumulating = ManualAccumulation()
    pl.Trainer(strategy="ringreduce", max_epochs=2, **QUIET).fit(
        accumulating, DataLoader(TensorDataset(X, Y), batch_size=B))
    two = TwoOptimizers()
    pl.Trainer(strategy="ringreduce", max_epochs=1, **QUIET).fit(
        two, DataLoader(TensorDataset(X, Y), batch_size=B))
    event("manual-patterns",
          accumulation=float((flat(accumulating.net) - reference(2, 2, 0.05, LR)).abs().max()),
          two_optimizers=float((torch.cat([flat(two.g), flat(two.d)])
                                - two_nets_reference()).abs().max()))


def amp_scaler() -> None:
    """float16 autocast with a GradScaler (on the CPU): the scaler unscales the averaged
    gradients; unscaling local ones first would step on 1024x gradients."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    model, scaler = Model().float(), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    trainer = pl.Trainer(strategy=rl.RingreduceStrategy(), max_epochs=2, **QUIET,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(model, DataLoader(TensorDataset(X.float(), Y.float()), batch_size=B))
    got = flat(model.net)
    spread = (rrt.allreduce(got, op=rrt.Max) - rrt.allreduce(got, op=rrt.Min)).abs().max()
    event("amp", diff=float((got.double() - reference(2, 1, None, LR)).abs().max()),
          spread=float(spread), scale=float(scaler.get_scale()))


def fabric_loop(directory: str) -> None:
    """Lightning Fabric: the user's own loop with accumulation (no_backward_sync) and
    clip_gradients, against the reference; then Fabric's collectives and save."""
    from lightning.fabric import Fabric

    fabric = Fabric(strategy="ringreduce", accelerator="cpu", devices=1)
    fabric.launch()  # as Fabric asks; the processes are the launch's, nothing starts
    net = network()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(X, Y), batch_size=B,
                                                 shuffle=True))
    quiet = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            with fabric.no_backward_sync(model, enabled=i % 2 == 0):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y) / 2)
            if i % 2 == 0:
                quiet.append(not opt.optimizer._rr_inflight)
                continue
            fabric.clip_gradients(model, opt, max_norm=0.05)
            opt.step()
            opt.zero_grad()
    got = flat(net)
    spread = (rrt.allreduce(got, op=rrt.Max) - rrt.allreduce(got, op=rrt.Min)).abs().max()
    norms = []  # a skipped step (clip, then zero_grad without step()), twice: each clip
    for r in range(2):  # sees that pass's averages (local norms would differ by rank)
        rows = slice((2 * r + fabric.global_rank) * B, (2 * r + fabric.global_rank + 1) * B)
        fabric.backward(torch.nn.functional.mse_loss(model(X[rows]), Y[rows]))
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=1e9)))
        opt.zero_grad()
    path = os.path.join(directory + "-fabric", "state.ckpt")
    fabric.save(path, {"model": model, "optimizer": opt})
    fabric.barrier()
    rank = float(fabric.global_rank)
    event("fabric", diff=float((got - reference(2, 2, 0.05, LR)).abs().max()),
          spread=float(spread), quiet=all(quiet), saved=os.path.exists(path),
          mean=float(fabric.all_reduce(torch.tensor(rank))),
          total=float(fabric.all_reduce(torch.tensor(rank), reduce_op="sum")),
          gathered=fabric.all_gather(torch.tensor([rank])).tolist(),
          broadcast=fabric.broadcast({"from": fabric.global_rank}, src=1),
          world=[fabric.world_size, fabric.global_rank], norms=norms)


class Logged(Model):
    """Logs a rank-dependent value with sync_dist and through a torchmetrics metric, and a
    stop signal only rank 0 gives."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.rank_metric = torchmetrics.MeanMetric()

    def training_step(self, batch: tuple, idx: int) -> torch.Tensor:
        self.rank_metric.update(torch.tensor(float(self.global_rank)))
        self.log("metric_mean", self.rank_metric, on_epoch=True, on_step=False)
        self.log("rank_mean", float(self.global_rank), sync_dist=True, on_epoch=True,
                 on_step=False)
        sign = 1.0 if self.global_rank == 0 else -1.0  # rank 0 stops improving, rank 1 not
        self.log("stopper", sign * self.current_epoch, on_epoch=True, on_step=False)
        return super().training_step(batch, idx)

    def validation_step(self, batch: tuple, idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch: tuple, idx: int) -> None:
        self.validation_step(batch, idx)

    def predict_step(self, batch: tuple, idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def on_train_end(self) -> None:
        r = float(self.global_rank)
        self.gathered = self.all_gather(torch.tensor([r, 2 * r])).tolist()
        x = torch.tensor(r + 1, requires_grad=True)
        self.all_gather(3 * x, sync_grads=True).sum().backward()
        self.gathered_grad = float(x.grad)
        self.uneven = [t.tolist() for t in rl.gather_all_tensors(torch.full((2 - int(r), 2), r))]


def callbacks(directory: str) -> None:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1,
                           filename="best")
    stop = EarlyStopping(monitor="stopper", mode="min", patience=0, check_on_train_epoch_end=True)
    model = Logged()
    trainer = pl.Trainer(strategy=rl.RingreduceStrategy(), max_epochs=6,
                         **{**QUIET, "enable_checkpointing": True},
                         callbacks=[ckpt, stop])
    data = DataLoader(TensorDataset(X, Y), batch_size=B)
    trainer.fit(model, data, DataLoader(TensorDataset(X, Y), batch_size=B))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    validated = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    tested = trainer.test(model, data, verbose=False)[0]["val_loss"]
    predicted = trainer.predict(model, data)
    rrt.barrier()
    event("callbacks", epochs=trainer.current_epoch, rank_mean=metrics["rank_mean"],
          val_loss=metrics["val_loss"], validated=validated, tested=tested,
          best=os.path.basename(ckpt.best_model_path), files=sorted(os.listdir(directory)),
          gathered=model.gathered, gathered_grad=model.gathered_grad, uneven=model.uneven,
          metric_mean=metrics["metric_mean"], predicted=sum(len(p) for p in predicted),
          world=[trainer.world_size, trainer.global_rank, trainer.is_global_zero])


def refusals() -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    strategy, caught = rl.RingreduceStrategy(), {}
    for what, call in {
        "group": lambda: strategy.reduce(torch.ones(1), group=object()),
        "op": lambda: strategy.reduce(torch.ones(1), reduce_op="median"),
        "scheduler": lambda: pl.Trainer(
            strategy=rl.RingreduceStrategy(), max_epochs=1, **QUIET,
            callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})]).fit(
                Model(), DataLoader(TensorDataset(X, Y), batch_size=B)),
    }.items():
        try:
            call()
        except InvalidInputError as err:
            caught[what] = str(err)
    event("refusals", caught=caught)


def die() -> None:
    class Exit(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_rank == 1 and trainer.global_step == 3:
                os._exit(17)

    start = time.time()
    try:
        pl.Trainer(strategy="ringreduce", max_epochs=50, **QUIET, callbacks=[Exit()]).fit(
            Model(), DataLoader(TensorDataset(X, Y), batch_size=B))
    except Exception as err:  # noqa: BLE001 - the class is what is checked
        error_event("fit-error", err)
        event("fit-error-after", seconds=time.time() - start)
        os._exit(3)
    raise AssertionError("fit finished although rank 1 died")


def devices_alone() -> None:
    """``python train.py`` with ``devices=2`` (no launcher): refused by both strategies."""
    from lightning.fabric import Fabric

    caught = {}
    for what, call in {
        "trainer": lambda: pl.Trainer(strategy="ringreduce", max_epochs=1,
                                      **{**QUIET, "devices": 2}).fit(
            Model(), DataLoader(TensorDataset(X, Y), batch_size=B)),
        "fabric": lambda: Fabric(strategy="ringreduce", accelerator="cpu", devices=2).launch(),
    }.items():
        try:
            call()
        except InvalidInputError as err:
            caught[what] = str(err)
    event("devices", caught=caught)


def main() -> None:
    import pytorch_lightning as ptl

    if sys.argv[1:] == ["--devices-alone"]:
        return devices_alone()
    rrt.init()
    set_rank(rrt.rank())
    equivalence("plain", rl.RingreduceStrategy())
    equivalence("accumulate-clip", rl.RingreduceStrategy(), k=2, clip=0.05)
    equivalence("horovod-lr", rl.HorovodStrategy())
    equivalence("manual", "ringreduce", manual=True)
    equivalence("pytorch_lightning", "horovod", package=ptl)
    manual_patterns()
    amp_scaler()
    fabric_loop(sys.argv[1])
    callbacks(sys.argv[1])
    refusals()
    rrt.barrier()
    say(f"OK rank {rrt.rank()}")
    die()  # last: it ends the job


if __name__ == "__main__":
    run(main)
