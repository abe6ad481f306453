"""ringreduce.tensorflow's process sets and grouped data movement, ranks as threads (one
TensorFlow runtime in pytest's own process): every collective with ``process_set=``, eager
and in ``tf.function``, among the set's members only; Horovod's ``size_op(process_set_id)``,
``process_set_included_op``, ``broadcast_object_fn`` and ``is_homogeneous``;
``grouped_allgather`` / ``grouped_reducescatter`` equal to the single calls, gradients too.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import ringreduce as rr  # noqa: E402
import ringreduce.tensorflow as rtf  # noqa: E402
from ringreduce.testing import make_world, run_threaded  # noqa: E402

try:  # a blocked collective op holds an inter-op thread: one per threaded rank at least
    tf.config.threading.set_inter_op_parallelism_threads(8)
except RuntimeError:  # the runtime started already (another module set it)
    pass

SETS = [[0, 2], [1, 2]]


def _value(rank: int, k: int = 5) -> tf.Tensor:
    return tf.constant(np.arange(k, dtype=np.float32) + 10 * rank)


def _every_collective(ps: rr.ProcessSet, r: int) -> dict:
    """One call of each ringreduce.tensorflow collective on ``ps`` by member ``r``."""
    var = tf.Variable(_value(r))
    rtf.broadcast_variables([var], root_rank=0, process_set=ps)

    @tf.function
    def summed(x: tf.Tensor) -> tf.Tensor:
        return rtf.allreduce(x, op=rtf.Sum, process_set=ps, name=f"traced.{ps.process_set_id}")

    traced_var = tf.Variable(_value(r) * 2)

    @tf.function
    def traced_inplace() -> tf.Tensor:
        return rtf.broadcast_([traced_var], root_rank=1, process_set=ps)[0]

    out = {
        "traced_inplace": traced_inplace().numpy(),
        "sum": rtf.allreduce(_value(r), op=rtf.Sum, process_set=ps),
        "avg": rtf.allreduce(_value(r), process_set=ps),
        "traced": summed(_value(r)),
        "gather": rtf.allgather(tf.fill([r + 1, 2], r), process_set=ps),
        "bcast": rtf.broadcast(_value(r), root_rank=ps.size() - 1, process_set=ps),
        "scatter": rtf.reducescatter(tf.ones([2 * ps.size(), 3]) * r, op=rtf.Sum,
                                     process_set=ps),
        "a2a": rtf.alltoall(tf.fill([ps.size()], r), process_set=ps)[0],
        "grouped": rtf.grouped_allreduce([_value(r, 3), _value(r, 7)], op=rtf.Max,
                                         process_set=ps),
        "ggather": rtf.grouped_allgather([tf.fill([r + 1, 2], r)], process_set=ps),
        "gscatter": rtf.grouped_reducescatter([tf.ones([2 * ps.size(), 3]) * r], op=rtf.Sum,
                                              process_set=ps),
        "obj": rtf.allgather_object({"rank": r}, process_set=ps),
        "bobj": rtf.broadcast_object(f"from {r}", root_rank=0, process_set=ps),
        "fn": rtf.broadcast_object_fn(root_rank=1, process_set=ps)(r),
        "var": var.numpy(),
        "inplace": rtf.broadcast_(tf.Variable(_value(r)), root_rank=1, process_set=ps).numpy(),
        "size": int(rtf.size_op(ps.process_set_id)),
        "in": int(rtf.process_set_included_op(ps.process_set_id)),
    }
    rtf.barrier(process_set=ps)
    return out


def _check(got: dict, members: list) -> None:
    k = len(members)
    total = sum(_value(m).numpy() for m in members)
    np.testing.assert_array_equal(got["sum"], total)
    np.testing.assert_array_equal(got["traced"], total)
    np.testing.assert_allclose(got["avg"], total / k)
    rows = np.concatenate([np.full((m + 1, 2), m, np.int32) for m in members])
    np.testing.assert_array_equal(got["gather"], rows)
    np.testing.assert_array_equal(got["ggather"][0], rows)
    np.testing.assert_array_equal(got["bcast"], _value(members[-1]))
    np.testing.assert_array_equal(got["scatter"], np.full((2, 3), float(sum(members))))
    np.testing.assert_array_equal(got["gscatter"][0], got["scatter"])
    np.testing.assert_array_equal(got["a2a"], np.array(members, np.int32))
    np.testing.assert_array_equal(got["grouped"][1], _value(max(members), 7))
    assert got["obj"] == [{"rank": m} for m in members]
    assert got["bobj"] == f"from {members[0]}" and got["fn"] == members[1]
    np.testing.assert_array_equal(got["var"], _value(members[0]))
    np.testing.assert_array_equal(got["inplace"], _value(members[1]))
    np.testing.assert_array_equal(got["traced_inplace"], _value(members[1]) * 2)
    assert (got["size"], got["in"]) == (k, 1)


def test_every_collective_runs_among_the_members_of_its_set():
    comms = make_world(3)

    def body(c):
        mine = [rr.ProcessSet(s) for s in SETS]
        c.process_sets.setup(mine)
        with rtf.use_communicator(c):
            r, out = c.rank(), {}
            for ps in mine:
                if not ps.included():
                    with pytest.raises(rr.InvalidInputError, match="not a member"):
                        rtf.allreduce(tf.ones(2), process_set=ps)
                    assert int(rtf.process_set_included_op(ps.process_set_id)) == 0
                    continue
                out[ps.process_set_id] = _every_collective(ps, r)
            with pytest.raises(rr.InvalidInputError, match="no process set has id 7"):
                rtf.size_op(7)
            return out, int(rtf.size_op()), rtf.is_homogeneous()

    try:
        results = run_threaded(3, body, world=comms, timeout=120)
    finally:
        for c in comms:
            c.close()
    for r, (out, size, homogeneous) in enumerate(results):
        assert sorted(out) == [i + 1 for i, s in enumerate(SETS) if r in s]
        for pid, got in out.items():
            _check(got, SETS[pid - 1])
        assert size == 3 and homogeneous


def test_is_homogeneous_compares_every_hosts_rank_count():
    for hosts, want in ((["a", "a", "b", "b"], True), (["a", "a", "a", "b"], False)):
        comms = make_world(4, host_ids=hosts)
        try:
            assert run_threaded(4, lambda c: c.is_homogeneous(), world=comms) == [want] * 4, hosts
        finally:
            for c in comms:
                c.close()


def test_grouped_allgather_and_reducescatter_equal_the_single_calls_with_gradients():
    def body(c):
        r = c.rank()
        with rtf.use_communicator(c):
            a = tf.Variable(tf.fill([r + 1, 2], float(r)))
            b = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]) * (r + 1))
            with tf.GradientTape(persistent=True) as tape:
                ga, gb = rtf.grouped_allgather([a, b], name="gg")
                (sb,) = rtf.grouped_reducescatter([b], op=rtf.Sum, name="gs")
                grouped = tf.reduce_sum(ga * 2.0) + tf.reduce_sum(gb ** 2) + tf.reduce_sum(sb * 3)
                single = (tf.reduce_sum(rtf.allgather(a, name="a") * 2.0)
                          + tf.reduce_sum(rtf.allgather(b, name="b") ** 2)
                          + tf.reduce_sum(rtf.reducescatter(b, op=rtf.Sum, name="s") * 3))
            return ([t.numpy() for t in (ga, gb, sb)],
                    [g.numpy() for g in tape.gradient(grouped, [a, b])],
                    [g.numpy() for g in tape.gradient(single, [a, b])])

    comms = make_world(2)
    try:
        results = run_threaded(2, body, world=comms, timeout=120)
    finally:
        for c in comms:
            c.close()
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    for r, (values, grouped, single) in enumerate(results):
        np.testing.assert_array_equal(values[0], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(values[1], np.concatenate([base, base * 2]))
        np.testing.assert_array_equal(values[2], (base * 3)[2 * r:2 * r + 2])
        for g, s in zip(grouped, single):
            np.testing.assert_allclose(g, s)
        assert np.abs(grouped[1]).sum() > 0
    assert rtf.grouped_allgather([]) == [] and rtf.grouped_reducescatter([]) == []


def test_tape_and_keras_optimizer_average_over_their_set_only():
    import keras

    comms = make_world(3)

    def body(c):
        ps = rr.ProcessSet([0, 2])
        c.process_sets.setup([ps])
        r = c.rank()
        with rtf.use_communicator(c):
            w = tf.Variable([1.0, 2.0])
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * float(r + 1))
            grad = rtf.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])[0]
            kw = keras.Variable([1.0, 2.0])
            opt = rtf.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=ps)
            opt.apply([tf.constant([float(r + 1)] * 2)], [kw])
            with pytest.raises(rr.InvalidInputError, match="Adasum runs over every rank"):
                rtf.DistributedGradientTape(tf.GradientTape(), op=rtf.Adasum, process_set=ps)
            return grad.numpy(), np.asarray(kw.numpy())

    try:
        results = run_threaded(3, body, world=comms, timeout=120)
    finally:
        for c in comms:
            c.close()
    members = (1 + 3) / 2  # ranks 0 and 2: gradients 1 and 3
    np.testing.assert_allclose(results[0][0], [members] * 2)
    np.testing.assert_allclose(results[2][0], [members] * 2)
    np.testing.assert_allclose(results[1][0], [2.0, 2.0])  # rank 1 keeps its own
    for r, own in ((0, members), (1, 2.0), (2, members)):
        np.testing.assert_allclose(results[r][1], [1.0 - own, 2.0 - own])
