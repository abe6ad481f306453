"""Horovod's PyTorch synthetic benchmark, run on ringreduce by changing only the import.

    mpirun -np 2 python examples/horovod/pytorch_synthetic_benchmark.py [--use-adasum]

The structure and flags of Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``:
random images and labels, warm-up batches, then ``--num-iters`` timed iterations of
``--num-batches-per-iter`` steps, images/sec per rank and in total (mean ± 1.96 std).
``--model`` names a ``torchvision.models`` model when torchvision is installed; without
it (it is not a ringreduce dependency) only the built-in ``small_resnet`` exists, a
ResNet-style CNN sized for a CPU. There is no CUDA path here (``--no-cuda`` is accepted).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

import ringreduce.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="small_resnet", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size")
parser.add_argument("--image-size", type=int, default=32, help="input image side")
parser.add_argument("--num-warmup-batches", type=int, default=2,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=5,
                    help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")


def small_resnet(num_classes: int = 1000) -> torch.nn.Module:
    """Four residual stages of two 3x3 convolutions each (about 1.2 M parameters)."""

    class Block(torch.nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = torch.nn.BatchNorm2d(cout)
            self.c2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = torch.nn.BatchNorm2d(cout)
            self.skip = torch.nn.Conv2d(cin, cout, 1, stride, bias=False) \
                if stride != 1 or cin != cout else torch.nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(self.b1(self.c1(x)))
            return F.relu(self.b2(self.c2(y)) + self.skip(x))

    widths = [32, 64, 128, 256]
    layers = [torch.nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
              torch.nn.BatchNorm2d(widths[0]), torch.nn.ReLU()]
    for i, w in enumerate(widths):
        layers.append(Block(widths[max(i - 1, 0)], w, 1 if i == 0 else 2))
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
               torch.nn.Linear(widths[-1], num_classes)]
    return torch.nn.Sequential(*layers)


def make_model(name: str) -> torch.nn.Module:
    if name == "small_resnet":
        return small_resnet()
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {name} needs torchvision (pip install torchvision); "
                         "without it use --model small_resnet") from None
    return getattr(models, name)()


def benchmark_step() -> None:
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s: str, nl: bool = True) -> None:
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


if __name__ == "__main__":
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)

    model = make_model(args.model)

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Set up fixed fake data
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % 1000

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()}")

    # Warm-up
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    # Benchmark
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
