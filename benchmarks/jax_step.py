"""A jitted JAX + optax training step: what averaging the gradients adds, ringreduce
against MPI (mpi4py) in the same run.

    mpirun -np 2 python benchmarks/jax_step.py [--width 1024] [--layers 8] [--steps 10]

Rows (interleaved, each the median of ``--reps`` blocks of ``--steps`` steps, the slowest
rank's time per step):

* ``no-comm``: the step without communication (each rank trains alone);
* ``ringreduce``: ``ringreduce.jax.DistributedOptimizer`` (one fused allreduce of the
  gradient pytree, an ordered host callback inside the jitted step);
* ``mpi-packed``: the same step averaging through mpi4py inside the same kind of callback,
  every leaf packed into one buffer and one ``MPI_Allreduce`` (how mpi4jax-style code does it);
* ``mpi-loop``: one ``MPI_Allreduce`` per leaf in the callback.

``adds`` is the step minus ``no-comm``: what the averaging costs. After the timing, every
implementation's parameters after the same steps are compared with ringreduce's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_common import init_ringreduce
from jax.experimental import io_callback
from mpi4py import MPI

import ringreduce.jax as hvd


def init_params(width: int, layers: int) -> list:
    keys = jax.random.split(jax.random.key(0), layers)
    return [{"w": jax.random.normal(k, (width, width)) / width ** 0.5, "b": jnp.zeros(width)}
            for k in keys]


def loss_fn(params: list, x: jax.Array) -> jax.Array:
    for p in params:
        x = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.mean(x ** 2)


def mpi_average(comm: MPI.Comm, packed: bool) -> Callable[[Any], Any]:
    """A pytree average through mpi4py inside an ordered host callback."""
    size = comm.Get_size()

    def host(*leaves: Any) -> list:
        arrays = [np.asarray(a) for a in leaves]
        if packed:
            flat = np.concatenate([a.ravel() for a in arrays])
            comm.Allreduce(MPI.IN_PLACE, flat)
            flat /= size
            out, at = [], 0
            for a in arrays:
                out.append(flat[at:at + a.size].reshape(a.shape))
                at += a.size
            return out
        outs = []
        for a in arrays:
            o = np.empty_like(a)
            comm.Allreduce(a, o)
            outs.append(o / size)
        return outs

    def average(grads: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(grads)
        specs = [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in leaves]
        return jax.tree_util.tree_unflatten(tree, io_callback(host, specs, *leaves,
                                                              ordered=True))

    return average


def make_step(tx: optax.GradientTransformation, average: Callable[[Any], Any]) -> Callable:
    @jax.jit
    def step(params: list, state: Any, x: jax.Array) -> tuple:
        grads = average(jax.grad(loss_fn)(params, x))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024, help="units per layer (1024)")
    p.add_argument("--layers", type=int, default=8, help="dense layers (8: 8.4 M parameters)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step (32)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block (10)")
    p.add_argument("--reps", type=int, default=5, help="timed blocks per row; median (5)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    _, say = init_ringreduce(comm)
    params = init_params(args.width, args.layers)
    n_params = sum(int(v.size) for v in jax.tree_util.tree_leaves(params))
    x = jax.random.normal(jax.random.key(1 + comm.Get_rank()), (args.batch, args.width))
    sgd = optax.sgd(0.01)
    rows = {
        "no-comm": (sgd, make_step(sgd, lambda g: g)),
        "ringreduce": (hvd.DistributedOptimizer(sgd), None),
        "mpi-packed": (sgd, make_step(sgd, mpi_average(comm, True))),
        "mpi-loop": (sgd, make_step(sgd, mpi_average(comm, False))),
    }
    rows["ringreduce"] = (rows["ringreduce"][0], make_step(rows["ringreduce"][0], lambda g: g))
    state = {k: tx.init(params) for k, (tx, _) in rows.items()}
    current = {k: params for k in rows}
    times: dict = {k: [] for k in rows}
    for k, (_, step) in rows.items():  # compile and warm up
        current[k], state[k] = step(current[k], state[k], x)
    for _ in range(args.reps):
        for k, (_, step) in rows.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                current[k], state[k] = step(current[k], state[k], x)
            jax.block_until_ready(current[k])
            times[k].append(comm.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX))
    say(f"# {comm.Get_size()} ranks, {n_params / 1e6:.1f} M float32 parameters "
        f"({n_params * 4 / 2 ** 20:.0f} MiB of gradients), batch {args.batch} per rank; "
        f"median of {args.reps} blocks of {args.steps} steps")
    base = statistics.median(times["no-comm"]) * 1e3
    say(f"{'row':12s} {'step ms':>9s} {'adds ms':>9s}")
    for k in rows:
        t = statistics.median(times[k]) * 1e3
        say(f"{k:12s} {t:9.2f} {t - base:9.2f}")
    ref = jax.tree_util.tree_leaves(current["ringreduce"])
    for k in ("mpi-packed", "mpi-loop"):
        diff = max(float(jnp.abs(a - b).max())
                   for a, b in zip(ref, jax.tree_util.tree_leaves(current[k])))
        say(f"# check {k} vs ringreduce: max |diff| {diff:.2e} "
            f"{'ok' if diff < 1e-4 else 'WRONG'}")


if __name__ == "__main__":
    main()
