"""Elastic JAX worker for tests/test_elastic_jax.py: ``elastic_jax_worker.py STEPS [die:W:S]``.

Fits a linear model with optax SGD through ``ringreduce.jax.DistributedOptimizer``; the
jitted step donates its arguments, so a state that kept references instead of copies
would be lost. ``JaxState`` holds the parameters, the optax state and the step; commits
every 5 steps. Each rank's data depends on its rank and the step, so the parameters
depend on which sizes ran which steps. Prints ``RESULT <worker> rank <r> size <n> step
<s> digest <hex of the parameters' bytes> w <w0,w1,w2,w3,b>``.
"""

import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ringreduce.jax as hvd

steps = int(sys.argv[1])
actions = [a.split(":") for a in sys.argv[2:]]
me = os.environ["RINGREDUCE_ELASTIC_WORKER"]

hvd.init()
tx = hvd.DistributedOptimizer(optax.sgd(0.1))
params = {"w": jnp.zeros(4, jnp.float32), "b": jnp.asarray(0.0)}
# `losses` starts empty: a fresh worker's [] and rank 0's [0.5, ...] must still be synced
# the same way (as an object) on both
state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), step=0, losses=[])


@jax.jit
def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def step_fn(p, o, x, y):
    grads = jax.grad(loss)(p, x, y)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o


step_jit = jax.jit(step_fn, donate_argnums=(0, 1))


@hvd.elastic.run
def train(state):
    while state.step < steps:
        rng = np.random.default_rng(1000 * state.step + hvd.rank())
        x = rng.normal(size=(8, 4)).astype(np.float32)
        y = x @ np.arange(1, 5, dtype=np.float32) + 0.5
        state.params, state.opt_state = step_jit(state.params, state.opt_state, x, y)
        state.step += 1
        state.losses.append(float(loss(state.params, x, y)))
        for a in actions:
            if a[0] == "die" and a[1] == me and int(a[2]) == state.step:
                os._exit(3)
        if state.step % 5 == 0:
            state.commit()


train(state)
leaves = jax.tree_util.tree_leaves(state.params)
digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in leaves)).hexdigest()[:16]
values = ",".join(f"{v:.6f}" for v in [*np.asarray(state.params["w"]), float(state.params["b"])])
assert len(state.losses) == state.step, (len(state.losses), state.step)
print(f"RESULT {me} rank {hvd.rank()} size {hvd.size()} step {state.step} digest {digest} "
      f"w {values}", flush=True)
hvd.shutdown()
