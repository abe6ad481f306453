"""Writes a checkpoint, then dies by SIGKILL in the middle of writing the next one.

    python torch_checkpoint_worker.py PATH --kill-at {write,fsync}

``write``: killed once more than 1 MiB of the new checkpoint has reached the
temporary file; ``fsync``: killed when the complete temporary file is being
flushed, just before the rename. Logs ``saved`` after the first checkpoint and
``dying`` right before the kill; reaching the end is a failure.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from workerlib import event, run

import ringreduce.checkpoint as ckpt
import ringreduce.torch as rrt


class KillingFile:
    """A file whose writes SIGKILL the process once ``limit`` bytes have been written."""

    def __init__(self, f, limit: int) -> None:
        self._f, self._limit, self._written = f, limit, 0

    def write(self, data) -> int:
        n = self._f.write(data)
        self._written += n
        if self._written > self._limit:
            self._f.flush()
            event("dying", where="write", written=self._written)
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--kill-at", choices=["write", "fsync"], required=True)
    args = p.parse_args()
    rrt.init()
    model = torch.nn.Linear(4, 3)
    torch.nn.init.constant_(model.weight, 1.0)
    rrt.save_checkpoint(args.path, model=model, epoch=1, big=torch.ones(1 << 18))
    event("saved", epoch=1)

    if args.kill_at == "write":
        open_temp = ckpt._open_temp
        ckpt._open_temp = lambda tmp: KillingFile(open_temp(tmp), 1 << 20)
    else:
        def fsync(fd: int) -> None:
            event("dying", where="fsync", size=os.fstat(fd).st_size)
            os.kill(os.getpid(), signal.SIGKILL)

        ckpt.os.fsync = fsync
    torch.nn.init.constant_(model.weight, 2.0)
    rrt.save_checkpoint(args.path, model=model, epoch=2, big=torch.full((1 << 22,), 2.0))
    event("survived")


if __name__ == "__main__":
    run(main)
