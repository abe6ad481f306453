"""ringreduce.jax in real processes: every collective eagerly and inside jax.jit, their
gradients, DistributedOptimizer (optax) against one process on the whole batch, the
broadcasts (weak types and placement kept, typed PRNG keys), checkpoints (their dtypes)
and errors. Each check raises on a wrong result.

    mpirun -np N python jax_worker.py DIR check
    python jax_worker.py DIR die        (env-var launch: rank 1 exits inside a jitted step)
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from workerlib import error_event, event, run, say, set_rank

import ringreduce.jax as hvd

RNG = np.random.default_rng(0)
X, Y = RNG.normal(size=(48, 5)).astype(np.float32), RNG.normal(size=(48, 1)).astype(np.float32)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {hvd.rank()}: {what}")


def close(a: object, b: object, what: str, tol: float = 1e-6) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    check(a.shape == b.shape and np.allclose(a, b, rtol=tol, atol=tol),
          f"{what}: got {a.tolist()}, want {b.tolist()}")


def eager_collectives() -> None:
    r, n = hvd.rank(), hvd.size()
    ranks = np.arange(n, dtype=np.float64)
    for dtype in (jnp.float32, jnp.int32, jnp.float16, jnp.bfloat16):
        x = jnp.full((2, 3), r + 1, dtype)
        out = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{np.dtype(dtype).name}")
        check(out.dtype == dtype and out.shape == (2, 3), f"allreduce dtype {out.dtype}")
        close(out, np.full((2, 3), n * (n + 1) / 2), f"allreduce Sum {dtype}")
    close(hvd.allreduce(jnp.full(4, r + 1.0)), np.full(4, (n + 1) / 2), "Average")
    close(hvd.allreduce(jnp.full(2, r + 1.0), op=hvd.Max), np.full(2, n), "Max")
    close(hvd.allreduce(jnp.full(2, r + 1.0), op=hvd.Sum, prescale_factor=2.0,
                        postscale_factor=0.5), np.full(2, n * (n + 1) / 2), "scales")
    close(hvd.allreduce(jnp.full(3, r + 1.0), compression=hvd.Compression.fp16,
                        op=hvd.Sum), np.full(3, n * (n + 1) / 2), "fp16 compression")
    a, b = hvd.grouped_allreduce([jnp.full(2, float(r)), jnp.full(3, 1, jnp.int32)],
                                 op=hvd.Sum)
    close(a, np.full(2, ranks.sum()), "grouped 0")
    close(b, np.full(3, n), "grouped 1")
    g = hvd.allgather(jnp.full((r + 1, 2), r, jnp.float32))
    close(g, np.concatenate([np.full((q + 1, 2), q) for q in range(n)]), "ragged allgather")
    close(hvd.broadcast(jnp.full(3, r * 1.5), n - 1), np.full(3, (n - 1) * 1.5), "broadcast")
    rows = 2 * n + 1
    mine = rows // n + (r < rows % n)
    start = sum(rows // n + (q < rows % n) for q in range(r))
    rs = hvd.reducescatter(jnp.arange(rows, dtype=jnp.float32) + r, op=hvd.Sum)
    close(rs, (np.arange(rows) * n + ranks.sum())[start:start + mine], "reducescatter")
    out = hvd.alltoall(jnp.repeat(jnp.arange(n, dtype=jnp.float32)[:, None], 2, 1) + 10 * r)
    close(out, np.repeat((np.full(n, r) + 10 * np.arange(n))[:, None], 2, 1), "alltoall")
    out, received = hvd.alltoall(jnp.arange(n + 1, dtype=jnp.float32),
                                 splits=[2] + [1] * (n - 1))
    check(received.tolist() == ([2] * n if r == 0 else [1] * n), f"splits {received}")
    hvd.barrier()
    check(hvd.broadcast_object({"from": r}, 1) == {"from": 1}, "broadcast_object")
    check(hvd.allgather_object(r * 2) == [2 * q for q in range(n)], "allgather_object")
    check(isinstance(ml_dtypes.bfloat16(1), ml_dtypes.bfloat16), "ml_dtypes")


def jitted_collectives() -> None:
    r, n = hvd.rank(), hvd.size()

    @jax.jit
    def f(x: jax.Array) -> tuple:
        return (hvd.allreduce(x, op=hvd.Sum) * 2, hvd.allgather(x[:2]), hvd.broadcast(x, 0),
                hvd.reducescatter(jnp.stack([x] * n), op=hvd.Sum),
                hvd.allreduce(x, op=hvd.Max, name="explicit"),
                hvd.allreduce(x, compression=hvd.Compression.bf16, op=hvd.Sum))

    for step in range(3):  # the same compiled collectives, run again
        x = jnp.full(4, float(r + step))
        s, gathered, b, rs, mx, bf = f(x)
        total = sum(q + step for q in range(n))
        close(s, np.full(4, 2 * total), "jit allreduce")
        close(gathered, np.repeat([q + step for q in range(n)], 2), "jit allgather")
        close(b, np.full(4, float(step)), "jit broadcast")
        close(rs, np.full((1, 4), total), "jit reducescatter")
        close(mx, np.full(4, n - 1 + step), "jit Max")
        close(bf, np.full(4, total), "jit bf16 compression", tol=0.05)
    engine = hvd._default_comm()._engine
    from_numpy = jax.jit(lambda: hvd.allreduce(np.full(2, r + 1.0, np.float32), op=hvd.Sum))
    before = engine.stats()["tensors"]
    for _ in range(3):  # a numpy input is staged into the program: it runs every time
        close(from_numpy(), np.full(2, n * (n + 1) / 2), "jit of a numpy input")
    check(engine.stats()["tensors"] - before == 3, "a numpy input inside jit ran at trace time")
    if r == 0:  # traced on one rank only, never run: the names of later calls still agree
        jax.jit(lambda y: hvd.allreduce(y) * 3).lower(jnp.ones(2))
    close(jax.jit(lambda y: hvd.allreduce(y, op=hvd.Sum))(jnp.ones(2)), np.full(2, n),
          "after a trace on one rank only")
    # grads: allreduce's is the same allreduce; broadcast's the average on the root
    x = jnp.full(3, r + 1.0)
    g = jax.jit(jax.grad(lambda y: (hvd.allreduce(y, op=hvd.Sum) ** 2).sum()))(x)
    close(g, np.full(3, 2 * n * n * (n + 1) / 2), "grad of allreduce Sum")
    g = jax.grad(lambda y: (hvd.broadcast(y, 0) * (r + 1)).sum())(x)
    close(g, np.full(3, (n + 1) / 2 if r == 0 else 0.0), "grad of broadcast")
    g = jax.jit(jax.grad(lambda y: (hvd.allgather(y) * (r + 1)).sum()))(x)
    close(g, np.full(3, (n + 1) / 2), "grad of allgather")
    g = jax.grad(lambda y: hvd.reducescatter(jnp.stack([y] * n), op=hvd.Sum).sum())(x)
    close(g, np.full((3,), float(n * n)), "grad of reducescatter")
    failed = None
    try:  # unequal rows inside jit: the ranks disagree on the traced shape
        jax.jit(lambda y: hvd.allgather(y, name="unequal"))(jnp.ones((1 if r == 0 else 2, 2)))
    except hvd.RingReduceError as err:
        failed = f"a JAX runtime error was expected outside run_translated, got {err!r}"
    except Exception as err:  # noqa: BLE001 - JAX's runtime error wraps ours
        failed = "" if "every rank must send" in str(err) else f"unequal rows: {err}"
    check(failed == "", failed or "unequal rows inside jit went through")
    try:
        hvd.run_translated(jax.jit(lambda y: hvd.allreduce(y, name="mm")),
                           jnp.ones(2 + r))
        check(n == 1, "a shape mismatch inside jit went through")
    except hvd.MismatchError as err:
        check("'mm'" in str(err), f"mismatch: {err}")


def process_sets() -> None:
    """Collectives and the optimizer on a process set of ranks 0 and the last."""
    r, n = hvd.rank(), hvd.size()
    if n < 3:
        return
    ps = hvd.add_process_set([0, n - 1])
    if r in (0, n - 1):
        close(hvd.allreduce(jnp.full(2, r + 1.0), op=hvd.Sum, process_set=ps),
              np.full(2, n + 1.0), "eager allreduce on a set")
        f = jax.jit(lambda y: hvd.allreduce(y, op=hvd.Sum, process_set=ps))
        close(f(jnp.full(2, float(r))), np.full(2, n - 1.0), "jit allreduce on a set")
        tx = hvd.DistributedOptimizer(optax.sgd(1.0), op=hvd.Sum, process_set=ps)
        p = {"w": jnp.zeros(2)}
        updates, _ = jax.jit(tx.update)({"w": jnp.full(2, r + 1.0)}, tx.init(p), p)
        close(updates["w"], np.full(2, -(n + 1.0)), "optimizer on a set")
    else:
        try:
            hvd.allreduce(jnp.ones(2), process_set=ps)
            check(False, "a rank outside the set took part")
        except hvd.InvalidInputError as err:
            check("not a member" in str(err) or "not in" in str(err), f"outside the set: {err}")
    hvd.remove_process_set(ps)


def uneven_join() -> None:
    """Rank r runs 2 + r jitted steps, then join(): the others' later steps average over
    the ranks still contributing (Horovod's join)."""
    r, n = hvd.rank(), hvd.size()
    tx = hvd.DistributedOptimizer(optax.sgd(1.0))
    p = {"w": jnp.zeros(2)}
    s = tx.init(p)

    @jax.jit
    def step(p: dict, s: optax.OptState) -> tuple:
        u, s = tx.update({"w": jnp.full(2, r + 1.0)}, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(2 + r):
        p, s = step(p, s)
    last = hvd.join()
    want = -sum(np.mean([q + 1.0 for q in range(n) if q + 2 > i]) for i in range(2 + r))
    close(p["w"], np.full(2, want), "steps after other ranks joined")
    check(last == n - 1, f"last joined {last}")


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def init_params(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (5, 8)) * 0.5, "b1": jnp.zeros(8),
            "w2": jax.random.normal(k2, (8, 1)) * 0.5}


def train(tx: optax.GradientTransformation, params: dict, xs: np.ndarray, ys: np.ndarray,
          batch: int) -> dict:
    state = tx.init(params)

    @jax.jit
    def step(p: dict, s: optax.OptState, x: jax.Array, y: jax.Array) -> tuple:
        grads = jax.grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    for i in range(0, len(xs), batch):
        params, state = step(params, state, xs[i:i + batch], ys[i:i + batch])
    return params


def optimizer_equivalence() -> None:
    """N ranks on interleaved shards of per-rank batch B == one process on batches of N*B."""
    r, n = hvd.rank(), hvd.size()
    per = 4
    steps = len(X) // (per * n)
    rows = np.concatenate([np.arange((s * n + r) * per, (s * n + r + 1) * per)
                           for s in range(steps)])
    for label, make, passes in (("sgd", lambda: optax.sgd(0.1, momentum=0.5), 1),
                                ("adam", lambda: optax.adam(0.01), 1),
                                ("sgd-k2", lambda: optax.sgd(0.1), 2)):
        start = init_params(1234 + r)  # different per rank: the broadcast must fix it
        params = hvd.broadcast_parameters(start, root_rank=0)
        tx = hvd.DistributedOptimizer(make(), backward_passes_per_step=passes)
        mine = train(tx, params, X[rows], Y[rows], per)
        big = per * n * passes
        ref_tx = make()
        ref = train(ref_tx, init_params(1234), X[:steps * per * n], Y[:steps * per * n], big)
        diff = max(float(jnp.abs(mine[k] - ref[k]).max()) for k in ref)
        event("equivalence", opt=label, diff=diff)
        check(diff < 1e-5, f"{label}: {diff} away from one process")
    engine = hvd._default_comm()._engine
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
    params = init_params(5)
    before = engine.stats()["tensors"]
    train(tx, params, X[:16], Y[:16], 4)  # 4 calls: two steps of the 3 leaves
    check(engine.stats()["tensors"] - before == 6, "accumulating calls communicated")
    leaves = hvd.broadcast_parameters({"f": np.float32(r), "i": 3 + r, "a": np.ones(2) * r}, 0)
    check(type(leaves["f"]) is np.float32 and type(leaves["i"]) is int
          and isinstance(leaves["a"], np.ndarray) and leaves["i"] == 3
          and float(leaves["f"]) == 0.0, f"leaf kinds {leaves}")
    try:
        bad = {"w": jnp.ones(2 + r)}
        hvd.broadcast_parameters(bad, 0)
        check(n == 1, "different parameter shapes went through")
    except hvd.InvalidInputError as err:
        check("ranks disagree" in str(err), f"broadcast_parameters: {err}")


def weak_types() -> None:
    """broadcast_parameters keeps each leaf's weak_type: a weak scalar (a learning rate from
    a Python float) must promote as before and not make a jitted step retrace."""
    r = hvd.rank()
    tree = {"lr": jnp.asarray(0.1 * (r + 1)), "w": jnp.full(2, float(r)),
            "wide": jnp.broadcast_to(float(r), (3,))}
    out = hvd.broadcast_parameters(tree, 0)
    kinds = {k: (v.dtype, v.weak_type) for k, v in out.items()}
    check(kinds == {k: (v.dtype, v.weak_type) for k, v in tree.items()}, f"weak types {kinds}")
    close(out["lr"], 0.1, "weak leaf value")
    close(out["wide"], np.zeros(3), "weak array value")
    check((out["lr"] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16, "weak promotion")
    traces = []

    @jax.jit
    def step(t: dict) -> jax.Array:
        traces.append(1)
        return t["lr"] * t["w"]

    step(tree)
    step(out)
    check(len(traces) == 1, "the broadcast tree retraced a jitted step")


def placement() -> None:
    """Eager results and broadcast trees stay where their inputs live: a committed array's
    device or sharding (a rank that placed its parameters on its own device must not find
    them moved to the default one), weak types included. Run with two host devices."""
    devs = jax.devices()
    check(len(devs) >= 2, f"placement needs two devices (XLA_FLAGS), got {devs}")
    d1, r = devs[1], hvd.rank()
    x = jax.device_put(jnp.full(3, r + 1.0), d1)
    for what, out in [("allreduce", hvd.allreduce(x, op=hvd.Sum, name="placed.ar")),
                      ("broadcast", hvd.broadcast(x, 0, name="placed.bc")),
                      ("grouped", hvd.grouped_allreduce([x, x], name="placed.g")[1]),
                      ("allgather", hvd.allgather(x, name="placed.ag")),
                      ("alltoall", hvd.alltoall(jax.device_put(jnp.ones(hvd.size()), d1),
                                                splits=[1] * hvd.size(), name="placed.a2a")[0])]:
        check(out.devices() == {d1} and out.committed, f"{what} placed on {out.devices()}")
    weak = jax.device_put(jnp.asarray(0.5 * (r + 1)), d1)
    out = hvd.allreduce(weak, name="placed.weak")
    check(out.weak_type and out.devices() == {d1},
          f"weak allreduce: weak {out.weak_type} on {out.devices()}")
    loose = hvd.allreduce(jnp.ones(2), name="placed.loose")
    check(not loose.committed, "an uncommitted input gave a committed result")
    mesh = jax.sharding.Mesh(np.array(devs[:2]), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    tree = {"w": jax.device_put(jnp.arange(4.0) + r, sharded), "lr": weak,
            "key": jax.device_put(jax.random.key(r), d1), "u": jnp.ones(2)}
    out = hvd.broadcast_parameters(tree, 0)
    check(out["w"].sharding == sharded, f"sharded leaf came back as {out['w'].sharding}")
    close(out["w"], np.arange(4.0), "sharded leaf value")
    check(out["lr"].weak_type and out["lr"].devices() == {d1}, "weak leaf placement")
    check(out["key"].devices() == {d1}, f"key placed on {out['key'].devices()}")
    check(not out["u"].committed, "an uncommitted leaf came back committed")


def keys_of(seed: int) -> dict:
    return {"fry": jax.random.key(seed), "rbg": jax.random.key(seed, impl="rbg"),
            "split": jax.random.split(jax.random.key(seed), 3)}


def same_keys(a: jax.Array, b: jax.Array, what: str) -> None:
    check(a.dtype == b.dtype and a.shape == b.shape
          and np.array_equal(jax.random.key_data(a), jax.random.key_data(b)),
          f"{what}: got {a!r}, want {b!r}")


def typed_keys() -> None:
    """Typed PRNG keys broadcast (in a train state, alone, eagerly and in jit), gather and
    alltoall through their key data; reductions refuse them."""
    r, n = hvd.rank(), hvd.size()
    state = {"params": {"w": jnp.full(2, float(r))}, "keys": keys_of(r)}
    out = hvd.broadcast_parameters(state, 0)
    for name, key in out["keys"].items():
        same_keys(key, keys_of(0)[name], f"broadcast_parameters {name}")
    same_keys(hvd.broadcast_optimizer_state(keys_of(r), 0)["rbg"], keys_of(0)["rbg"],
              "broadcast_optimizer_state")
    same_keys(hvd.broadcast(jax.random.key(r), n - 1), jax.random.key(n - 1), "broadcast")
    same_keys(jax.jit(lambda k: hvd.broadcast(k, 0))(jax.random.key(r)), jax.random.key(0),
              "jit broadcast")
    want = jnp.concatenate([jax.random.split(jax.random.key(q), 2) for q in range(n)])
    same_keys(hvd.allgather(jax.random.split(jax.random.key(r), 2)), want, "allgather")
    same_keys(jax.jit(hvd.allgather)(jax.random.split(jax.random.key(r), 2)), want,
              "jit allgather")
    want = jnp.stack([jax.random.split(jax.random.key(q), n)[r] for q in range(n)])
    same_keys(hvd.alltoall(jax.random.split(jax.random.key(r), n)), want, "alltoall")
    same_keys(hvd.broadcast_object({"k": jax.random.key(r)}, 0)["k"], jax.random.key(0),
              "broadcast_object")
    for label, call in (("allreduce", lambda: hvd.allreduce(jax.random.key(r))),
                        ("grouped_allreduce",
                         lambda: hvd.grouped_allreduce([jnp.ones(2), jax.random.key(r)])),
                        ("reducescatter", lambda: hvd.reducescatter(keys_of(r)["split"])),
                        ("jit allreduce", lambda: jax.jit(hvd.allreduce)(jax.random.key(r)))):
        try:
            call()
            check(False, f"{label} of a PRNG key went through")
        except hvd.InvalidInputError as err:
            check("PRNG key" in str(err) and "key_data" in str(err), f"{label}: {err}")
    if n > 1:  # ranks with different key implementations: the same error everywhere
        try:
            hvd.broadcast_parameters({"k": jax.random.key(0, impl="rbg" if r else None)}, 0)
            check(False, "keys of different implementations went through")
        except hvd.InvalidInputError as err:
            check("ranks disagree" in str(err) and "key<" in str(err), f"impls: {err}")


def checkpoints(directory: str) -> None:
    params = hvd.broadcast_parameters(init_params(7), 0)
    tx = hvd.DistributedOptimizer(optax.adam(0.01))
    state = hvd.broadcast_optimizer_state(tx.init(params), 0)
    path = os.path.join(directory, "ckpt.pkl")
    extra = {"f64": np.linspace(0, 1, 3), "i64": np.arange(3, dtype=np.int64) + 2 ** 40,
             "names": np.array(["a", "b"]), "key": jax.random.key(5),
             "lr": jnp.asarray(0.5), "wide": jnp.broadcast_to(2.0, (2,)), "step": jnp.asarray(7)}
    wrote = hvd.save_checkpoint(path, params=params, opt_state=state, epoch=3, extra=extra)
    check(wrote == (hvd.rank() == 0), f"save_checkpoint returned {wrote}")
    hvd.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = hvd.load_checkpoint(path)
    # x64 off: 64-bit leaves narrow as jnp.asarray narrows them, and a warning says so
    got = {k: v.dtype for k, v in back["extra"].items() if k != "key"}
    check(got == {"f64": jnp.float32, "i64": jnp.int32, "names": np.dtype("<U1"),
                  "lr": jnp.float32, "wide": jnp.float32, "step": jnp.int32}, f"{got}")
    # weak types survive the file: a weak learning rate still promotes to bfloat16
    weak = {k: back["extra"][k].weak_type for k in ("lr", "wide", "step")}
    check(weak == {"lr": True, "wide": True, "step": True}, f"weak types after loading {weak}")
    check((back["extra"]["lr"] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16, "weak lr")
    check(not back["params"]["w1"].weak_type and set(back) == {"params", "opt_state", "epoch",
                                                              "extra"}, f"loaded keys {set(back)}")
    check(isinstance(back["extra"]["names"], np.ndarray), "a string array is not numpy")
    same_keys(back["extra"]["key"], jax.random.key(5), "a key in a checkpoint")
    said = [str(w.message) for w in caught if "jax_enable_x64" in str(w.message)]
    check(len(said) == 1 and "['extra']['f64'] float64 -> float32" in said[0]
          and "['extra']['i64'] int64 -> int32" in said[0], f"narrowing warnings {said}")
    with jax.enable_x64(True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wide = hvd.load_checkpoint(path)["extra"]
        check(wide["f64"].dtype == jnp.float64 and wide["i64"].dtype == jnp.int64
              and isinstance(wide["i64"], jax.Array) and int(wide["i64"][0]) == 2 ** 40,
              f"x64 on: {wide}")
        check(not [w for w in caught if "jax_enable_x64" in str(w.message)],
              "a warning with x64 on")
    check(back["epoch"] == 3, "epoch")
    close(back["params"]["w1"], params["w1"], "loaded params")
    check(type(back["opt_state"]) is type(state), f"optax state type {type(back['opt_state'])}")
    check(hvd.load_checkpoint(os.path.join(directory, "none"), missing_ok=True) is None,
          "missing_ok")
    event("checkpoint", files=sorted(os.listdir(directory)))


def die() -> None:
    tx = hvd.DistributedOptimizer(optax.sgd(0.01))
    params = hvd.broadcast_parameters(init_params(3), 0)
    state = tx.init(params)

    @jax.jit
    def step(p: dict, s: optax.OptState) -> tuple:
        updates, s = tx.update(jax.grad(loss_fn)(p, X[:4], Y[:4]), s, p)
        return optax.apply_updates(p, updates), s

    start = time.time()
    try:
        for i in range(100000):
            if hvd.rank() == 1 and i == 20:
                os._exit(17)
            params, state = hvd.run_translated(step, params, state)
    except Exception as err:  # noqa: BLE001 - the class is what is checked
        error_event("step-error", err)
        event("step-error-after", seconds=time.time() - start)
        sys.exit(3)


def main() -> None:
    try:
        hvd.rank()
        raise AssertionError("rank() before init() went through")
    except hvd.NotInitializedError:
        pass
    hvd.init(process_sets="dynamic")
    set_rank(hvd.rank())
    if sys.argv[2] == "die":
        die()
        return
    eager_collectives()
    jitted_collectives()
    optimizer_equivalence()
    weak_types()
    placement()
    typed_keys()
    process_sets()
    uneven_join()
    checkpoints(sys.argv[1])
    hvd.barrier()
    say(f"OK rank {hvd.rank()}")
    hvd.shutdown()


if __name__ == "__main__":
    run(main)
