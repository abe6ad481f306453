"""ringreduce.tensorflow with ranks as threads: collectives eager and in tf.function, dtypes,
gradients, zero copies, DistributedGradientTape, TF1 graphs, errors, checkpoints.

One process imports TensorFlow once (slow) and runs every case here; Keras ``fit`` and
the faults run in real processes (test_tensorflow_multiprocess.py).
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import ringreduce as rr  # noqa: E402
import ringreduce.tensorflow as rtf  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

# Ranks as threads share one TensorFlow runtime: a collective op blocks its inter-op thread
# until every rank's op runs, so the pool needs a thread per rank (real ranks are processes).
try:
    tf.config.threading.set_inter_op_parallelism_threads(8)
except RuntimeError:  # the runtime started already (another test module imported it first)
    pass

DTYPES = [tf.uint8, tf.int8, tf.int16, tf.uint16, tf.int32, tf.uint32, tf.int64, tf.uint64,
          tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.bool]


def run(n, fn, return_exceptions=False):
    def body(c):
        with rtf.use_communicator(c):
            return fn(c.rank())

    return run_threaded(n, body, timeout=120, return_exceptions=return_exceptions)


def contribution(rank, dtype, shape=(5, 3)):
    rng = np.random.default_rng(rank)
    if dtype == tf.bool:
        return tf.constant(rng.random(shape) < 0.6)
    values = rng.integers(1 if dtype.is_floating else 0, 4, shape)
    return tf.cast(tf.constant(values), dtype)


def test_horovod_names_and_queries():
    for name in ("init", "shutdown", "rank", "size", "local_rank", "local_size", "allreduce",
                 "grouped_allreduce", "allgather", "broadcast", "broadcast_variables",
                 "broadcast_object", "allgather_object", "reducescatter", "alltoall", "join",
                 "barrier", "DistributedOptimizer", "DistributedGradientTape",
                 "BroadcastGlobalVariablesHook", "broadcast_global_variables", "Compression",
                 "save_checkpoint", "load_checkpoint", "Adasum"):
        assert hasattr(rtf, name), name
    assert rtf.nccl_built() is False and rtf.mpi_built() is False
    import ringreduce.keras as rk
    import ringreduce.tensorflow.keras as hvd_keras

    assert hvd_keras.DistributedOptimizer is rk.DistributedOptimizer
    assert hvd_keras.callbacks.MetricAverageCallback
    assert run(2, lambda rank: (int(rtf.size_op()), int(rtf.rank_op()))) == [(2, 0), (2, 1)]
    assert rtf.Compression.fp16.wire == tf.float16
    with pytest.raises(rr.NotInitializedError):
        rtf.allreduce(tf.ones([2]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce_every_dtype_eager_and_in_tf_function(dtype):
    ops = [rr.Sum, rr.Min, rr.Max] + ([rr.Average] if dtype != tf.bool else [])

    def fn(rank):
        x = contribution(rank, dtype)
        eager = [rtf.allreduce(x, op=op, name=f"e{op}").numpy() for op in ops]
        graph = tf.function(lambda t: [rtf.allreduce(t, op=op, name=f"g{op}") for op in ops])
        out = graph(x)
        assert all(o.dtype == dtype and o.shape == x.shape for o in out)
        return eager, [o.numpy() for o in out]

    res = run(3, fn)
    stack = np.stack([contribution(r, dtype).numpy().astype(np.float64) for r in range(3)])
    expect = {rr.Sum: stack.sum(0), rr.Min: stack.min(0), rr.Max: stack.max(0),
              rr.Average: stack.sum(0) / 3}
    for eager, graph in res:
        for op, e, g in zip(ops, eager, graph):
            want = expect[op]
            if dtype == tf.bool:
                want = want > 0 if op != rr.Min else want == 1
            if dtype.is_integer and op == rr.Average:
                want = np.trunc(want)
            np.testing.assert_allclose(e.astype(np.float64), want, rtol=1e-2)
            np.testing.assert_array_equal(e, g)


def test_data_movement_and_gradients():
    def fn(rank):
        v = tf.Variable(tf.fill([rank + 1, 2], float(rank + 1)))
        with tf.GradientTape(persistent=True) as tape:
            gathered = rtf.allgather(v * 1.0, name="g")
            b = rtf.broadcast(v[:1] * 1.0, root_rank=1, name="b")
            a = rtf.allreduce(v[:1] * 1.0, op=rr.Sum, name="a")
            rs = rtf.reducescatter(tf.ones([3, 2]) * (rank + 1), op=rr.Sum, name="rs")
            loss = tf.reduce_sum(gathered * gathered)
            sums = [tf.reduce_sum(b), tf.reduce_sum(a)]
        grads = [tape.gradient(loss, v), tape.gradient(sums[0], v), tape.gradient(sums[1], v)]
        sent = tf.constant([10 * rank + i for i in range(3)])
        received, splits = rtf.alltoall(sent, splits=[2, 1] if rank == 0 else [1, 2])
        return (gathered.numpy(), b.numpy(), rs.numpy(), [g.numpy() for g in grads],
                received.numpy(), splits.numpy())

    r0, r1 = run(2, fn)
    np.testing.assert_array_equal(r0[0], [[1, 1], [2, 2], [2, 2]])
    np.testing.assert_array_equal(r0[1], [[2, 2]])
    np.testing.assert_array_equal(r0[2], [[3, 3], [3, 3]])
    np.testing.assert_array_equal(r1[2], [[3, 3]])
    # Horovod's convention: the average over ranks of d(sum(gathered^2))/dv = 2 * v
    np.testing.assert_array_equal(r0[3][0], 2 * np.ones([1, 2]))
    np.testing.assert_array_equal(r1[3][0], 4 * np.ones([2, 2]))
    np.testing.assert_array_equal(r1[3][1], [[1, 1], [0, 0]])  # root gets the average
    np.testing.assert_array_equal(r0[3][1], [[0, 0]])
    np.testing.assert_array_equal(r0[3][2], [[2, 2]])  # Sum allreduce: Sum of gradients
    np.testing.assert_array_equal(r0[4], [0, 1, 10])
    np.testing.assert_array_equal(r1[4], [2, 11, 12])
    np.testing.assert_array_equal(r1[5], [1, 2])


def test_tensors_reach_the_engine_and_come_back_without_copies():
    from ringreduce.tensorflow import _bridge

    x = tf.random.normal([1000])
    view = _bridge._to_array(x, False)
    assert view.ctypes.data == np.from_dlpack(x).ctypes.data  # no copy on the way in
    from ringreduce._arrays import empty_aligned

    out = empty_aligned((1000,), np.float32)
    t = _bridge._to_tensor(out, False)
    out[3] = 42.0
    assert t.numpy()[3] == 42.0  # the tensor is the engine's output buffer
    y = run(1, lambda rank: rtf.allreduce(x, op=rr.Sum).numpy())[0]
    np.testing.assert_array_equal(y, x.numpy())


def test_eager_calls_outside_a_tape_skip_the_graph_machinery(monkeypatch):
    """An eager allreduce that no GradientTape records (a metric) calls the engine
    directly, with neither tf.py_function (~0.4 ms) nor tf.custom_gradient (~0.1 ms);
    under a tape it stays differentiable; inside tf.function it is a graph op."""
    used = []
    real_py_function, real_custom_gradient = tf.py_function, tf.custom_gradient

    def py_function(*args, **kwargs):
        used.append("py_function")
        return real_py_function(*args, **kwargs)

    def custom_gradient(f):
        used.append("custom_gradient")
        return real_custom_gradient(f)

    monkeypatch.setattr(tf, "py_function", py_function)
    monkeypatch.setattr(tf, "custom_gradient", custom_gradient)

    def fn(rank):
        steps = []
        metric = rtf.allreduce(tf.constant([rank + 1.0]), op=rr.Sum, name="metric")
        steps.append(len(used))
        var = tf.Variable([rank + 1.0])  # read into a tensor first, as a py_function would
        metric = metric + rtf.allreduce(var, op=rr.Sum, name="var") + rtf.broadcast(var, 1)
        v = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            y = rtf.allreduce(v * (rank + 1.0), op=rr.Sum, name="y")
            with tape.stop_recording():
                logged = rtf.allreduce(tf.reduce_sum(y), op=rr.Sum, name="logged")
            loss = tf.reduce_sum(y)
        steps.append(len(used))
        grad = tape.gradient(loss, v)
        graph = tf.function(lambda t: rtf.allreduce(t, op=rr.Sum, name="graph"))(v)
        return metric.numpy(), logged.numpy(), grad.numpy(), graph.numpy(), steps

    res = run(2, fn)
    for rank, (metric, logged, grad, graph, _) in enumerate(res):
        assert metric.tolist() == [8.0] and logged == 18.0
        # Horovod's gradient of a Sum allreduce: the Sum allreduce of the gradient (2 ranks)
        assert grad.tolist() == [2.0 * (rank + 1)] * 2 and graph.tolist() == [2.0, 4.0]
    assert [s[0] for _, _, _, _, s in res] == [0, 0], used  # the metric: neither
    assert used.count("custom_gradient") >= 2 and used.count("py_function") >= 1, used


def test_grouped_allreduce_compression_and_indexed_slices():
    def fn(rank):
        xs = [tf.fill([3], float(rank + 1)), tf.fill([2, 2], 2.0 * (rank + 1))]
        g = rtf.grouped_allreduce(xs, op=rr.Sum, compression=rtf.Compression.fp16, name="grp")
        fp16 = rtf.allreduce(tf.constant([1.0 / 3] * 4, tf.float64),
                             compression=rtf.Compression.fp16)
        sl = tf.IndexedSlices(tf.fill([1, 2], float(rank + 1)), tf.constant([rank]),
                              tf.constant([2, 2]))
        avg = rtf.allreduce(sl, op=rr.Average, name="slices")
        pre = rtf.allreduce(tf.ones([2]), op=rr.Sum, prescale_factor=2.0, postscale_factor=0.5)
        return ([t.numpy() for t in g], fp16.numpy(), fp16.dtype, avg.indices.numpy(),
                tf.convert_to_tensor(avg).numpy(), pre.numpy())

    for grouped, fp16, dtype, indices, dense, pre in run(2, fn):
        np.testing.assert_array_equal(grouped[0], [3, 3, 3])
        np.testing.assert_array_equal(grouped[1], np.full([2, 2], 6.0))
        assert dtype == tf.float64 and abs(fp16[0] - 1 / 3) < 1e-3 and fp16[0] != 1 / 3
        np.testing.assert_array_equal(indices, [0, 1])
        np.testing.assert_array_equal(dense, [[0.5, 0.5], [1.0, 1.0]])
        np.testing.assert_array_equal(pre, [2.0, 2.0])


def _reference_step(weights, xs, ys):
    w = tf.Variable(weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))
    return tape.gradient(loss, w).numpy()


def test_distributed_gradient_tape_averages_like_one_big_batch():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
    w0 = rng.normal(size=(3, 1))

    def fn(rank):
        w = tf.Variable(w0)
        emb = tf.Variable(tf.ones([4, 2], tf.float64))

        @tf.function
        def step(xs, ys):
            with tf.GradientTape() as tape:
                pred = tf.matmul(xs, w) + tf.reduce_sum(tf.gather(emb, [rank]))
                loss = tf.reduce_mean(tf.square(pred - ys))
            tape = rtf.DistributedGradientTape(tape)
            return tape.gradient(loss, [w, emb])

        gw, gemb = step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        assert isinstance(gemb, tf.IndexedSlices)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [0, rank])) * (rank + 1)
        dense = rtf.DistributedGradientTape(tape, sparse_as_dense=True).gradient(loss, emb)
        return gw.numpy(), dense.numpy()

    res = run(2, fn)
    emb_offset = 2.0  # tf.reduce_sum of one embedding row of ones
    want = _reference_step(w0, x, y - emb_offset)
    for gw, dense in res:
        np.testing.assert_allclose(gw, want, rtol=1e-12)
        np.testing.assert_array_equal(dense[:2], [[2.0, 2.0], [1.0, 1.0]])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_custom_loop_with_the_tape_ends_with_one_process_weights(opt):
    import keras

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(3, 8, 3)), rng.normal(size=(3, 8, 1))
    w0 = rng.normal(size=(3, 1))
    make = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.05)}[opt]

    def train(rank, size, distributed):
        w = tf.Variable(w0 * (rank + 1))  # different until the broadcast
        o = make()
        if distributed:
            o.build([w])
            rtf.broadcast_variables([w] + list(o.variables), root_rank=0)

        @tf.function
        def step(xs, ys, first):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))
            if distributed:
                tape = rtf.DistributedGradientTape(tape)
            o.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            if first and distributed:  # Horovod's recipe (a no-op here: equal already)
                rtf.broadcast_variables([w] + list(o.variables), root_rank=0)

        for k in range(3):
            rows = slice(rank * 8 // size, (rank + 1) * 8 // size)
            step(x[k, rows], y[k, rows], k == 0)
        return w.numpy()

    want = train(0, 1, False)
    for got in run(2, lambda rank: train(rank, 2, True)):
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_tf1_graph_optimizer_hook_and_local_aggregation(opt):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
    w0 = rng.normal(size=(3, 1))
    make = {"sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.125),
            "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.125)}[opt]

    def fn(rank, size, passes):
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", initializer=w0 * (rank + 1))  # differ: bcast
            xs = tf.compat.v1.placeholder(tf.float64, [None, 3])
            ys = tf.compat.v1.placeholder(tf.float64, [None, 1])
            loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))
            train = rtf.DistributedOptimizer(make(), backward_passes_per_step=passes,
                                             average_aggregated_gradients=True).minimize(loss)
            hooks = [rtf.BroadcastGlobalVariablesHook(0)]
            with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
                for step in range(2):  # two applications
                    for k in range(passes):
                        part = 8 // size // passes
                        start = rank * 8 // size + k * part
                        rows = slice(start, start + part)
                        sess.run(train, {xs: x[rows] + step, ys: y[rows]})
                return sess.run(w)

    (want,) = run(1, lambda rank: fn(rank, 1, 1))  # one process, full batches
    for passes in (1, 2):
        for got in run(2, lambda rank, p=passes: fn(rank, 2, p)):
            np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("mode", ["tf_function", "tf1_graph"])
def test_local_aggregation_of_embedding_gradients(mode):
    """backward_passes_per_step=2 with an embedding (tf.gather: an IndexedSlices gradient,
    beside a dense one). In a tf.function the slices' dense_shape is a tensor of the traced
    function, which the accumulator (made under init_scope) cannot use: it takes the
    variable's shape, the slices are summed into it, and the ranks end with one process's
    weights on the full batches."""
    rng = np.random.default_rng(3)
    ids, y = rng.integers(0, 6, size=(2, 8)), rng.normal(size=(2, 8, 1))  # two applications
    emb0, w0 = rng.normal(size=(6, 3)), rng.normal(size=(3, 1))

    def loss_of(emb, w, i, t):
        return tf.reduce_mean(tf.square(tf.matmul(tf.gather(emb, i), w) - t))

    def batches(rank, size, passes):  # rank's k-th part of each application's rows
        part = 8 // size // passes
        for step in range(2):
            for k in range(passes):
                rows = slice(rank * 8 // size + k * part, rank * 8 // size + (k + 1) * part)
                yield ids[step, rows], y[step, rows]

    def optimizer(passes):
        return rtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.125),
                                        backward_passes_per_step=passes,
                                        average_aggregated_gradients=True)

    def in_tf_function(rank, size, passes):
        emb, w, opt = tf.Variable(emb0), tf.Variable(w0), optimizer(passes)

        @tf.function
        def step(i, t):
            with tf.GradientTape() as tape:
                loss = loss_of(emb, w, i, t)
            grads = tape.gradient(loss, [emb, w])
            assert isinstance(grads[0], tf.IndexedSlices)
            opt.apply_gradients(zip(grads, [emb, w]))

        for i, t in batches(rank, size, passes):
            step(i, t)
        return np.concatenate([emb.numpy().ravel(), w.numpy().ravel()])

    def in_tf1_graph(rank, size, passes):
        with tf.Graph().as_default():
            emb = tf.compat.v1.get_variable("emb", initializer=emb0)
            w = tf.compat.v1.get_variable("w", initializer=w0)
            i = tf.compat.v1.placeholder(tf.int64, [None])
            t = tf.compat.v1.placeholder(tf.float64, [None, 1])
            train = optimizer(passes).minimize(loss_of(emb, w, i, t))
            with tf.compat.v1.train.MonitoredTrainingSession() as sess:
                for i_, t_ in batches(rank, size, passes):
                    sess.run(train, {i: i_, t: t_})
                return np.concatenate([v.ravel() for v in sess.run([emb, w])])

    fn = in_tf_function if mode == "tf_function" else in_tf1_graph
    (want,) = run(1, lambda rank: fn(rank, 1, 1))  # one process, full batches
    for got in run(2, lambda rank: fn(rank, 2, 2)):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_tf1_adasum_delta_optimizer():
    """DistributedOptimizer(op=Adasum) on a TF1 optimizer is Horovod's delta optimizer: each
    rank steps locally (k steps with backward_passes_per_step=k), then the variables become
    the start plus the Adasum of the ranks' changes."""
    from ringreduce._adasum import adasum_combine

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 4, 1))  # each rank's rows
    w0, lr = rng.normal(size=(3, 1)), 0.125  # exact in float32, as TF1 optimizers keep it

    def grad(w, rank):
        return 2 * x[rank].T @ (x[rank] @ w - y[rank]) / len(x[rank])

    def fn(rank, passes):
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", initializer=w0 * (rank + 1))  # differ: bcast
            xs = tf.compat.v1.placeholder(tf.float64, [None, 3])
            ys = tf.compat.v1.placeholder(tf.float64, [None, 1])
            loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))
            opt = rtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr),
                                           op=rtf.Adasum, backward_passes_per_step=passes)
            train = opt.minimize(loss)
            assert type(opt).__name__ == "DistributedAdasumTF1Optimizer"
            assert opt.get_slot_names() == ["delta_start"] and len(opt.variables()) == 2
            hooks = [rtf.BroadcastGlobalVariablesHook(0)]
            with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
                for _ in range(2 * passes):  # two combinations
                    sess.run(train, {xs: x[rank], ys: y[rank]})
                return sess.run(w)

    for passes in (1, 2):
        want = w0.copy()
        for _ in range(2):
            deltas = []
            for rank in range(2):
                w = want.copy()
                for _ in range(passes):
                    w = w - lr * grad(w, rank)
                deltas.append((w - want).ravel())
            want = want + adasum_combine(*deltas).reshape(want.shape)
        for got in run(2, lambda rank, p=passes: fn(rank, p)):
            np.testing.assert_allclose(got, want, rtol=1e-12)
    (alone,) = run(1, lambda rank: fn(0, 1))  # one rank: plain SGD
    want = w0.copy()
    for _ in range(2):
        want = want - lr * grad(want, 0)
    np.testing.assert_allclose(alone, want, rtol=1e-12)
    with pytest.raises(rr.InvalidInputError, match="gradient_predivide_factor"):
        rtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 op=rtf.Adasum, gradient_predivide_factor=2.0)


def later(rank, late_rank):
    """0.0 as a graph op: at once, or half a second late on ``late_rank``. Added to a
    collective's input, it makes that rank submit the collective after the others of the
    same session.run, whose inputs are at hand."""
    if rank != late_rank:
        return tf.constant(0.0)
    return tf.numpy_function(lambda: np.float32(time.sleep(0.5) or 0), [], tf.float32)


def test_tf1_unnamed_collectives_do_not_depend_on_the_run_order():
    # A tf.compat.v1 graph has no automatic control dependencies: two unnamed allreduces
    # of one session.run run in either order. Here rank 0 submits a first, rank 1 b first;
    # both are named when the graph is built, so a still meets a (they used to be matched
    # by the order they ran in: rank 0's a was averaged with rank 1's b, on both ranks).
    def fn(rank):
        with tf.Graph().as_default():
            a = rtf.allreduce(tf.constant([1.0, 2.0, 3.0]) * (rank + 1) + later(rank, 1))
            b = rtf.allreduce(tf.constant([10.0, 20.0, 30.0]) * (rank + 1) + later(rank, 0))
            with tf.compat.v1.Session() as sess:
                return sess.run([a, b])

    for got_a, got_b in run(2, fn):
        np.testing.assert_array_equal(got_a, [1.5, 3, 4.5])
        np.testing.assert_array_equal(got_b, [15, 30, 45])


# 12 collectives in one graph: more than the 8 inter-op threads, which the library warns of
# (test_tf1_graph_with_more_collectives_than_inter_op_threads_warns_once); each pair runs alone
@pytest.mark.filterwarnings("ignore:ringreduce.tensorflow. this tf.compat.v1 graph now holds")
def test_tf1_every_unnamed_collective_is_named_when_the_graph_is_built():
    # Pairs of unnamed collectives, each pair fetched by one session.run in which rank 0
    # submits the first one first and rank 1 the second one (see later), twice: every kind, a
    # gradient, two tf.cond branches (graphs of their own inside the v1 graph: they must
    # not share a name) and two broadcast_variables ops.
    def fn(rank):
        def bcast_variables(var, root, gate):
            with tf.control_dependencies([gate]):  # the variable is read after the gate
                return rtf.broadcast_variables([var], root_rank=root)

        with tf.Graph().as_default():
            ones, v = tf.ones([2]), tf.ones([2]) * (rank + 1)
            w1, w2 = tf.Variable(ones * (rank + 1)), tf.Variable(ones * (rank + 10))
            pred = tf.compat.v1.placeholder_with_default(True, [])
            pairs = [
                (lambda g: rtf.allreduce(v + g, op=rr.Sum),
                 lambda g: rtf.allgather(tf.fill([rank + 1, 2], float(rank)) + g)),
                (lambda g: rtf.broadcast(ones * (rank + 5) + g, root_rank=1),
                 lambda g: rtf.grouped_allreduce([v + g, 2 * v], op=rr.Sum)),
                (lambda g: rtf.reducescatter(tf.reshape(tf.range(4.0), [4, 1]) * (rank + 1)
                                             + g, op=rr.Sum),
                 lambda g: rtf.alltoall(tf.constant([[10.0 * rank], [10.0 * rank + 1]]) + g)[0]),
                (lambda g: tf.gradients(rtf.allreduce(v, op=rr.Sum), v,
                                        grad_ys=ones * (rank + 1) + g)[0],
                 lambda g: rtf.allreduce(v + g, op=rr.Min)),
                (lambda g: tf.cond(pred, lambda: rtf.allreduce(v + g, op=rr.Sum), lambda: ones),
                 lambda g: tf.cond(pred, lambda: rtf.allreduce(10 * v + g, op=rr.Sum),
                                   lambda: ones)),
                (lambda g: bcast_variables(w1, 0, g), lambda g: bcast_variables(w2, 1, g)),
            ]
            fetches = [[first(later(rank, 1)), second(later(rank, 0))] for first, second in pairs]
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for _ in range(2):
                    got = [sess.run(pair) for pair in fetches]
                got[-1] = sess.run([w1, w2])
                return got

    for rank, got in enumerate(run(2, fn)):
        want = [([3, 3], [[0, 0], [1, 1], [1, 1]]), ([6, 6], [[3, 3], [6, 6]]),
                ([[0], [3]] if rank == 0 else [[6], [9]], [[rank], [10 + rank]]),
                ([3, 3], [1, 1]), ([3, 3], [30, 30]), ([1, 1], [11, 11])]
        for i, (g, w) in enumerate(zip(got, want)):
            for j in range(2):
                np.testing.assert_array_equal(np.asarray(g[j]), w[j], err_msg=f"pair {i}.{j}")


def test_tape_with_adasum_combines_the_gradients():
    """DistributedGradientTape(op=Adasum) (Horovod's): the ranks' gradients combined with
    Adasum, unscaled; an IndexedSlices gradient is densified first."""
    from ringreduce._adasum import adasum_combine

    def fn(rank):
        v = tf.Variable([1.0, 2.0, -1.0], dtype=tf.float64)
        table = tf.Variable(tf.ones([3, 2], tf.float64))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v * (rank + 1) + v * rank) + tf.reduce_sum(
                tf.gather(table, [rank]) * (rank + 2))
        grads = rtf.DistributedGradientTape(tape, op=rtf.Adasum).gradient(loss, [v, table])
        return [tf.convert_to_tensor(g).numpy() for g in grads]

    v = np.array([1.0, 2.0, -1.0])
    want_v = adasum_combine(*[2 * v * (r + 1) + r for r in range(2)])
    rows = [np.zeros((3, 2)) for _ in range(2)]
    for r in range(2):
        rows[r][r] = r + 2
    want_t = adasum_combine(*[t.ravel() for t in rows]).reshape(3, 2)
    for got_v, got_t in run(2, fn):
        np.testing.assert_allclose(got_v, want_v, rtol=1e-12)
        np.testing.assert_allclose(got_t, want_t, rtol=1e-12)
    with pytest.raises(rr.InvalidInputError, match="gradient_predivide_factor"):
        with tf.GradientTape() as tape:
            pass
        rtf.DistributedGradientTape(tape, op=rtf.Adasum, gradient_predivide_factor=2.0)


def test_broadcast_variables_checkpoints_and_objects(tmp_path):
    path = str(tmp_path / "ckpt.pkl")

    def fn(rank):
        m = tf.Module()
        m.w = tf.Variable(tf.fill([2, 2], float(rank)))
        m.step = tf.Variable(rank, dtype=tf.int64)
        rtf.broadcast_variables([m.w, m.step], root_rank=1)
        wrote = rtf.save_checkpoint(path, model=m, epoch=4)
        rtf.barrier()
        m.w.assign(tf.zeros([2, 2]))
        data = rtf.load_checkpoint(path, model=m)
        obj = rtf.broadcast_object({"rank": rank}, root_rank=1)
        return wrote, m.w.numpy(), int(m.step.numpy()), data["epoch"], obj

    for rank, (wrote, w, step, epoch, obj) in enumerate(run(2, fn)):
        assert wrote == (rank == 0) and epoch == 4 and obj == {"rank": 1} and step == 1
        np.testing.assert_array_equal(w, np.ones([2, 2]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pkl"]


def test_broadcast_variables_traced_then_retraced_on_one_rank_only():
    # A tf.function holding broadcast_variables that rank 1 traces twice (its last batch is
    # smaller): the broadcasts are named when they run, so the eager one after it matches
    # (it used to be named at trace time, and the ranks waited on different names).
    def fn(rank):
        w = tf.Variable(tf.ones([3]) * (rank + 1))

        @tf.function
        def step(x, first):
            if first:
                rtf.broadcast_variables([w], root_rank=0)
            return tf.reduce_sum(x)

        n = 8 if rank == 0 else 7
        for i, start in enumerate(range(0, n, 4)):
            step(tf.ones([min(4, n - start), 3]), tf.constant(i == 0))
        w.assign(tf.ones([3]) * (rank + 5))
        rtf.broadcast_variables([w], root_rank=0)
        return step.experimental_get_tracing_count(), w.numpy()

    (t0, w0), (t1, w1) = run(2, fn)
    assert (t0, t1) == (1, 2)
    np.testing.assert_array_equal(w0, [5, 5, 5])
    np.testing.assert_array_equal(w1, [5, 5, 5])


def test_errors_are_ringreduce_errors_on_every_rank():
    def mismatch(rank):
        return rtf.allreduce(tf.ones([2 + rank]), name="bad")

    errs = run(2, mismatch, return_exceptions=True)
    assert all(isinstance(e, rr.MismatchError) for e in errs), errs
    assert "rank 0 called allreduce float32[2]" in str(errs[0])

    def in_graph(rank):
        return tf.function(lambda: rtf.allreduce(tf.ones([2 + rank]), name="bad2"))()

    errs = run(2, lambda rank: rtf.run_translated(in_graph, rank), return_exceptions=True)
    assert all(isinstance(e, rr.MismatchError) for e in errs), errs

    def bad_input(rank):
        with pytest.raises(rr.InvalidInputError, match="complex64 is not supported"):
            rtf.allreduce(tf.ones([2], tf.complex64))
        with pytest.raises(rr.InvalidInputError, match="string"):
            rtf.allreduce(tf.constant(["a"]))
        with pytest.raises(rr.InvalidInputError, match="scalar"):
            rtf.allgather(tf.constant(1.0))
        with pytest.raises(rr.InvalidInputError, match="root_rank"):
            rtf.broadcast(tf.ones([1]), root_rank=5)
        with pytest.raises(rr.InvalidInputError, match="op must be"):
            rtf.allreduce(tf.ones([1]), op=7)
        with pytest.raises(rr.InvalidInputError, match="eager"):
            rtf.broadcast_global_variables(0)
        with pytest.raises(rr.InvalidInputError, match="GradientTape"):
            rtf.DistributedGradientTape(object())
        with pytest.raises(rr.InvalidInputError, match="gradient_predivide_factor"):
            rtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                     op=rr.Sum, gradient_predivide_factor=2.0)
        return True

    assert run(2, bad_input) == [True, True]

    def refused_on_one_rank(rank):  # the TF layer's own check, on rank 1 only (eager)
        return rtf.allreduce(tf.ones([2], tf.complex64 if rank else tf.float32))

    errs = run(2, refused_on_one_rank, return_exceptions=True)
    assert isinstance(errs[1], rr.InvalidInputError), errs
    assert "rank 1 refused this call locally" in str(errs[0]), errs
    assert [float(t[0]) for t in run(2, lambda rank: rtf.allreduce(tf.ones([1])))] == [1.0, 1.0]


def test_tape_options_predivide_sum_and_compression():
    def fn(rank):
        v = tf.Variable([1.0, 2.0])
        out = {}
        for key, kwargs in {"pre": {"gradient_predivide_factor": 2.0},
                            "sum": {"op": rr.Sum},
                            "bf16": {"compression": rtf.Compression.bf16}}.items():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * v) * (rank + 1)
            out[key] = rtf.DistributedGradientTape(tape, **kwargs).gradient(loss, v).numpy()
        return out

    for out in run(2, fn):
        np.testing.assert_allclose(out["pre"], [3.0, 6.0])  # (2v + 4v) / 2, in two halves
        np.testing.assert_allclose(out["sum"], [6.0, 12.0])
        np.testing.assert_allclose(out["bf16"], [3.0, 6.0])


def test_tf1_graph_with_more_collectives_than_inter_op_threads_warns_once():
    # Each collective holds an inter-op thread until every rank submitted it: more of them
    # in one session.run than threads can deadlock (see _bridge._warn_if_threads_may_run_out)
    threads = tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count()

    def fn(rank):
        with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = tf.ones([2])
            outs = [rtf.allreduce(x, name=f"many.{i}") for i in range(threads)]
            assert not caught, [str(w.message) for w in caught]
            outs += [rtf.allreduce(x), rtf.allreduce(x)]
            assert len(caught) == 1 and caught[0].category is RuntimeWarning, caught
            assert f"{threads + 1} collective ops" in str(caught[0].message)
            assert caught[0].filename == __file__  # the line that built the op
        with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rtf.grouped_allreduce([tf.ones([2])] * (threads + 4))  # one op
            assert not caught, [str(w.message) for w in caught]
        return len(outs)

    assert run(1, fn) == [threads + 2]
