"""Keras training throughput and scaling: ringreduce.keras vs MultiWorkerMirroredStrategy.

    python benchmarks/keras_scaling.py [--steps 30] [--warmup 3] [--repeats 3] [--batch 32]
                                       [--model resnet-ish|small] [--nps 1 2]

Trains the same Keras CNN (TensorFlow backend, float32, SGD with momentum,
``jit_compile=False``) on synthetic 32x32x3 images at each process count with

``ringreduce``
    ``rr.DistributedOptimizer`` + ``rr.callbacks.BroadcastGlobalVariablesCallback(0)``, the
    ranks started with the env-var launch (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1,
    MASTER_PORT=<free port>); every rank feeds its own batches of ``--batch``.
``MWMS``
    ``tf.distribute.MultiWorkerMirroredStrategy``, TF_CONFIG on loopback (one free port per
    worker, task index = rank), model built and compiled in ``strategy.scope()``; its
    dataset is batched at the global batch (``--batch`` x workers), auto-sharding OFF (the
    data is synthetic), which Keras splits into ``--batch`` per worker.

Both train with ``model.fit`` of ``--warmup + --steps`` steps in one epoch (one step per
execution); a callback records the time at every ``on_train_batch_end``, and the timed
interval runs from the end of the last warm-up step to the end of the last step, so graph
tracing and the initial broadcast are not counted. Global samples/s = np x batch x steps /
the slowest rank's interval; scaling efficiency = thr(np) / (np / np_min x thr(np_min)), each
library against its own smallest -np. Every process pins TensorFlow to one intra-op and one
inter-op thread (``--threads``; also OMP_NUM_THREADS and tf.data's private pool), so that
np=2 on a 2-core machine is a fair doubling of the work; the header states the setting.

Every launch is a fresh set of processes in their own sessions, with a hard deadline
(``--timeout``); the whole group is SIGKILLed on the way out, whatever happens. A worker
reports one JSON line, then waits for the driver to close its stdin before exiting, so no
rank leaves while a peer may still need it for the last collective. Configurations are
interleaved (np outer, library inner, ``--repeats`` rounds), so a noisy stretch of a shared
machine hits each of them; the table reports the best of the repeats, and every launch is
printed as a ``#`` line too. Lines starting with ``# target:`` state whether the issue's
targets (ringreduce >= MWMS at np=2; ringreduce efficiency >= 90%) were met in this run.
Every rank trains on its own data, so equal trainable weights on all ranks at the end show
that the gradients were averaged; ``# check:`` says so, and the run fails if they differ.
Workers also watch for their driver going away (and their own deadline) and exit then.
A third row, ``no communication (floor)``, runs np independent processes training the same
model alone: its np=2 "efficiency" is what this machine gives two processes when no library
is involved, the ceiling for both libraries' efficiency.

Keras 3's ``model.fit`` does not run under MWMS with more than one worker as released
(keras-team/keras#20585): it reduces the first input batch, an (x, y) tuple, with
``strategy.reduce``, and averages the scalar loss over workers along ``axis=0``; both
raise. The MWMS worker works around the two (``setup_mwms``, ``patch_keras_for_mwms``):
the model is built symbolically from a local batch, and the logs are averaged with
``axis=None``. The gradients' all-reduce, the thing measured, is TensorFlow's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

LIBRARIES = ("ringreduce", "mwms", "alone")
LABELS = {"ringreduce": "ringreduce", "mwms": "MWMS", "alone": "no communication (floor)"}
RESULT = "RESULT "
# Variables by which ringreduce (or mpi4py, or TensorFlow) would think a launcher started a
# child: scrubbed from every worker's environment, which then gets its own launch variables.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "RINGREDUCE_SECRET", "RINGREDUCE_HOST_ID", "TF_CONFIG")
LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_", "I_MPI_", "MV2_",
                   "SLURM_")


# --------------------------------------------------------------------- model
def make_model(kind: str):
    """The benchmark's CNN: ``resnet-ish`` (1.2 M parameters) or ``small`` (for smoke tests)."""
    import keras
    from keras import layers

    def block(x, width: int, stride: int):
        y = layers.Conv2D(width, 3, stride, padding="same", use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.Conv2D(width, 3, 1, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if stride != 1 or x.shape[-1] != width:
            x = layers.Conv2D(width, 1, stride, use_bias=False)(x)
            x = layers.BatchNormalization()(x)
        return layers.ReLU()(layers.Add()([x, y]))

    stages = ((32, 1), (64, 2), (128, 2), (256, 2)) if kind == "resnet-ish" else ((8, 1), (16, 2))
    inputs = keras.Input((32, 32, 3))
    x = layers.Conv2D(stages[0][0], 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for width, stride in stages:
        x = block(x, width, stride)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x), name=f"cnn_{kind.replace('-', '_')}")


def compile_model(model, optimizer) -> None:
    import keras

    model.compile(optimizer=optimizer, jit_compile=False, steps_per_execution=1,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def dataset(seed: int, batch: int, threads: int) -> tuple:
    """Synthetic images and labels: 4 batches of ``batch``, cached and repeated forever;
    and the first batch as numpy arrays."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4 * batch, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, 4 * batch).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.threading.private_threadpool_size = threads
    options.threading.max_intra_op_parallelism = 1
    return ds.cache().repeat().with_options(options), (x[:batch], y[:batch])


# -------------------------------------------------------------------- worker
def setup_ringreduce(args) -> tuple:
    import keras

    import ringreduce.keras as rr

    rr.init()
    model = make_model(args.model)
    opt = rr.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    compile_model(model, opt)
    callbacks = [rr.callbacks.BroadcastGlobalVariablesCallback(0)]
    ds, _ = dataset(rr.rank(), args.batch, args.threads)
    return rr.rank(), rr.size(), model, ds, callbacks, rr.shutdown


def setup_alone(args) -> tuple:
    """The floor: np processes each training by itself (plain SGD, nothing exchanged), so
    np=2 shows what the machine gives two processes when no library is involved."""
    import keras

    model = make_model(args.model)
    compile_model(model, keras.optimizers.SGD(0.01, momentum=0.9))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds, _ = dataset(rank, args.batch, args.threads)
    return rank, size, model, ds, [], None


def patch_keras_for_mwms() -> None:
    """Keras 3's train step averages its logs across MWMS workers with
    ``strategy.reduce("MEAN", v, axis=0)``, which fails on the scalar loss as soon as there
    are two workers ("Invalid reduction dimension 0 for input with 0 dimensions",
    keras-team/keras#20585): average scalars over the replicas (``axis=None``) instead.
    The gradients' all-reduce (the optimizer's, through the replica context) is untouched."""
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(strategy):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica


def setup_mwms(args) -> tuple:
    import keras
    import tensorflow as tf

    patch_keras_for_mwms()
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    size = strategy.num_replicas_in_sync
    with strategy.scope():
        model = make_model(args.model)
        compile_model(model, keras.optimizers.SGD(0.01, momentum=0.9))
    ds, (x, y) = dataset(rank, args.batch * size, args.threads)

    # Keras 3's fit passes its first distributed (x, y) batch to strategy.reduce to learn the
    # input shapes, which MWMS with more than one worker refuses ("Attempt to convert a
    # value (PerReplica...) to a Tensor", keras-team/keras#20585): build from one local
    # batch instead, as fit would have (only its shapes and dtypes are used).
    def symbolic_build(iterator=None, data_batch=None) -> None:
        with strategy.scope():
            model._symbolic_build(data_batch=(x[:args.batch], y[:args.batch]))

    object.__setattr__(model, "_maybe_symbolic_build", symbolic_build)
    return rank, size, model, ds, [], None


def watchdog(seconds: float) -> None:
    """End this worker if it outlives ``seconds`` or its driver (its parent) goes away, even
    when a peer died and a collective would wait forever."""
    parent, deadline = os.getppid(), time.monotonic() + seconds

    def watch() -> None:
        while time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.5)
        sys.stderr.write("keras_scaling worker: timed out or orphaned, exiting\n")
        os._exit(124)

    threading.Thread(target=watch, daemon=True).start()


def worker(args) -> None:
    """One rank: train, print one RESULT line, wait for the driver's go, exit."""
    watchdog(args.timeout + 10)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    setup = {"ringreduce": setup_ringreduce, "mwms": setup_mwms,
             "alone": setup_alone}[args.worker]
    rank, size, model, ds, callbacks, finish = setup(args)
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None) -> None:
            times.append(time.perf_counter())

    model.fit(ds, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
              callbacks=[*callbacks, Timer()])
    elapsed = times[-1] - times[args.warmup - 1]
    checksum = sum(float(np.sum(np.asarray(w, np.float64))) for w in model.trainable_weights)
    print(RESULT + json.dumps({
        "library": args.worker, "rank": rank, "np": size, "elapsed": elapsed,
        "checksum": checksum,
        "params": model.count_params(), "tf": tf.__version__, "keras": keras.__version__,
        "intra": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter": tf.config.threading.get_inter_op_parallelism_threads()}), flush=True)
    sys.stdin.read()  # the driver closes stdin once every rank has reported
    if finish is not None:
        finish()
    sys.stdout.flush()
    os._exit(0)  # skip TensorFlow's teardown (its gRPC server can linger)


# -------------------------------------------------------------------- driver
def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def child_env(extra: dict) -> dict:
    """This environment minus launcher variables, one thread everywhere, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    env.update({"PYTHONUNBUFFERED": "1", "KERAS_BACKEND": "tensorflow",
                "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch_envs(library: str, n: int, threads: int) -> list[dict]:
    threads_env = {"OMP_NUM_THREADS": threads, "TF_NUM_INTRAOP_THREADS": threads,
                   "TF_NUM_INTEROP_THREADS": threads}
    if library == "alone":
        return [child_env({**threads_env, "RANK": r, "WORLD_SIZE": n}) for r in range(n)]
    if library == "ringreduce":
        port = free_ports(1)[0]
        return [child_env({**threads_env, "RANK": r, "WORLD_SIZE": n, "LOCAL_RANK": r,
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                for r in range(n)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(n)]}
    return [child_env({**threads_env, "TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": r}})}) for r in range(n)]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process's session (it leads its own group), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def tail(f, chars: int = 3000) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")[-chars:]


def collect(procs: list, files: list, deadline: float, what: str) -> list[dict]:
    """Poll the ranks' stdout files until each printed its RESULT line; fail fast if a rank
    exits without one or the deadline passes."""
    results: list = [None] * len(procs)
    while True:
        for r, (proc, (out, err)) in enumerate(zip(procs, files)):
            if results[r] is None:
                out.seek(0)
                for line in out.read().decode(errors="replace").splitlines():
                    if line.startswith(RESULT):
                        results[r] = json.loads(line[len(RESULT):])
            if results[r] is None and proc.poll() is not None:
                raise SystemExit(f"{what}: rank {r} exited with {proc.returncode} before "
                                 f"reporting; its stderr ends:\n{tail(err)}")
        if all(results):
            return results
        if time.monotonic() > deadline:
            stuck = [r for r, res in enumerate(results) if res is None]
            raise SystemExit(f"{what}: ranks {stuck} did not report within the timeout; "
                             f"rank {stuck[0]}'s stderr ends:\n{tail(files[stuck[0]][1])}")
        time.sleep(0.1)


def launch(library: str, n: int, args) -> dict:
    """Start n workers, gather their results, let them exit; return the job's numbers."""
    what = f"{LABELS[library]} -np {n}"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", library,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--model", args.model, "--threads", str(args.threads), "--timeout", str(args.timeout)]
    deadline = time.monotonic() + args.timeout
    procs: list = []
    files: list = []
    try:
        for env in launch_envs(library, n, args.threads):
            files.append((tempfile.TemporaryFile(), tempfile.TemporaryFile()))
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                          stdout=files[-1][0], stderr=files[-1][1],
                                          start_new_session=True))
        results = collect(procs, files, deadline, what)
        for p in procs:
            p.stdin.close()
        for r, (p, (_, err)) in enumerate(zip(procs, files)):
            try:
                code = p.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{what}: rank {r} did not exit after reporting") from None
            if code != 0:
                raise SystemExit(f"{what}: rank {r} exited with {code}; its stderr ends:\n"
                                 f"{tail(err)}")
    finally:
        for p in procs:
            kill_group(p)
        for out, err in files:
            out.close()
            err.close()
    slowest = max(res["elapsed"] for res in results)
    sums = [res["checksum"] for res in results]
    # Each rank trains on its own data: only averaged gradients keep the weights equal.
    agree = library == "alone" or \
        max(sums) - min(sums) <= 1e-6 * max(1.0, max(abs(c) for c in sums))
    return {**results[0], "np": n, "step_s": slowest / args.steps, "agree": agree,
            "samples_per_s": n * args.batch * args.steps / slowest}


def machine_info() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return (f"# machine: {platform.node()}, {model}, {os.cpu_count()} CPUs ({usable} usable), "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def report(runs: dict, args, start_load: str) -> None:
    """The header, the table (best launch of each configuration) and the target lines."""
    results = {key: max(rs, key=lambda r: r["samples_per_s"]) for key, rs in runs.items()}
    first = results["ringreduce", args.nps[0]]
    print(f"\n{machine_info()}\n# TensorFlow {first['tf']}, Keras {first['keras']}, "
          f"threads per process: intra-op {first['intra']}, inter-op {first['inter']}, "
          f"OMP_NUM_THREADS={args.threads}\n# model: {args.model} CNN, "
          f"{first['params'] / 1e6:.2f} M parameters, 32x32x3 synthetic inputs, float32, "
          f"SGD(momentum 0.9), jit_compile=False; batch {args.batch} per rank; "
          f"{args.warmup} warm-up + {args.steps} timed steps per launch; best of "
          f"{args.repeats} interleaved launches\n# load average: {start_load} at start, "
          f"{load()} at end\n")
    base = min(args.nps)
    print(f"| library | np | samples/s (global) | efficiency vs own np={base} "
          "| ratio rr/MWMS at same np | every launch, samples/s |")
    print("|---|---|---|---|---|---|")
    effs, spreads = [], []
    for n in args.nps:
        for lib in LIBRARIES:
            thr = results[lib, n]["samples_per_s"]
            eff = thr / (n / base * results[lib, base]["samples_per_s"])
            effs += [eff] if n != base else []
            ratio = thr / results["mwms", n]["samples_per_s"] if lib == "ringreduce" else None
            every = [r["samples_per_s"] for r in runs[lib, n]]
            spreads.append(1 - min(every) / max(every))
            print(f"| {LABELS[lib]} | {n} | {thr:.1f} | {eff:.0%} | "
                  f"{'' if ratio is None else f'{ratio:.2f}'} | "
                  f"{', '.join(f'{v:.1f}' for v in every)} |")
    if max(effs, default=0) > 1.05 or max(spreads) > 0.15:
        print(f"\n# note: noisy run: launches of one configuration differ by up to "
              f"{max(spreads):.0%}, the highest efficiency is {max(effs, default=1):.0%}; the "
              "machine's speed changed between launches: read the targets with care")
    if 1 in args.nps and 2 in args.nps:
        rr2, mw2 = results["ringreduce", 2]["samples_per_s"], results["mwms", 2]["samples_per_s"]
        eff = rr2 / (2 * results["ringreduce", 1]["samples_per_s"])
        print(f"\n# target: ringreduce >= MWMS throughput at np=2: "
              f"{'MET' if rr2 >= mw2 else 'NOT MET'} ({rr2:.1f} vs {mw2:.1f} samples/s, "
              f"ratio {rr2 / mw2:.2f})")
        floor = results["alone", 2]["samples_per_s"] / (2 * results["alone", 1]["samples_per_s"])
        print(f"# target: ringreduce scaling efficiency >= 90% at np=2: "
              f"{'MET' if eff >= 0.9 else 'NOT MET'} ({eff:.0%}; two processes with no "
              f"communication at all reach {floor:.0%} on this machine; load average at end "
              f"{load()})")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=30, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (>= 1: the first one traces the graph)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--model", choices=("resnet-ish", "small"), default="resnet-ish")
    p.add_argument("--nps", type=int, nargs="+", default=[1, 2], help="process counts")
    p.add_argument("--repeats", type=int, default=3,
                   help="launches per configuration, interleaved; the best one counts")
    p.add_argument("--threads", type=int, default=1,
                   help="TensorFlow intra-op and inter-op threads per process")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch, hard")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be at least 1")
    args.nps = sorted(set(args.nps))
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    # SIGTERM runs the launch's finally (which kills the workers) instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start_load = load()
    runs: dict = {}
    agree: list[bool] = []
    for _ in range(args.repeats):  # interleaved, so a noisy stretch hits every configuration
        for n in args.nps:
            for lib in LIBRARIES:
                r = launch(lib, n, args)
                print(f"# {LABELS[lib]} -np {n}: {r['samples_per_s']:.1f} samples/s "
                      f"({r['step_s'] * 1000:.0f} ms/step), weights equal across ranks: "
                      f"{'yes' if r['agree'] else 'NO'}", flush=True)
                agree.append(r["agree"])
                runs.setdefault((lib, n), []).append(r)
    report(runs, args, start_load)
    print(f"# check: trainable weights equal across ranks after training: "
          f"{'OK' if all(agree) else 'WRONG'} in {agree.count(True)} of {len(agree)} launches")
    if not all(agree):
        sys.exit(1)


if __name__ == "__main__":
    main()
