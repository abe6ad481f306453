"""Bad input and disagreement between ranks: clear errors, and the library stays usable."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded


class DLPackOnly:
    """An object that offers nothing but the DLPack protocol."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kwargs):
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


@pytest.fixture(scope="module")
def pair():
    comms = make_world(2)
    yield comms
    for c in comms:
        c.close()


@pytest.fixture(scope="module")
def lonely():
    """A world whose rank 0 alone makes calls that fail its own checks. Each refused call
    takes its place in the order of calls and is told to rank 0 (so that the others' calls
    of its name fail instead of waiting), which leaves this world's ranks out of step:
    tests that need a working collective use ``pair``."""
    comms = make_world(2)
    yield comms
    for c in comms:
        c.close()


def both(pair, fn):
    return run_threaded(2, fn, world=pair, return_exceptions=True)


def test_dlpack_input_in_place(pair):
    bufs = [np.full(5, r + 1.0, np.float32) for r in range(2)]
    both(pair, lambda c: c.allreduce_(DLPackOnly(bufs[c.rank()]), op=rr.Sum))
    assert all((b == 3).all() for b in bufs)


@pytest.mark.parametrize("bad, match", [
    (np.zeros(3, np.float16).astype(np.longdouble), "float128 is not supported"),
    (np.zeros(3, np.complex64), "complex64 is not supported"),
    (object(), "expected a numpy array"),
])
def test_unsupported_inputs(lonely, bad, match):
    with pytest.raises(rr.InvalidInputError, match=match):
        lonely[0].allreduce(bad)


def test_in_place_needs_contiguous_writable(lonely):
    with pytest.raises(rr.InvalidInputError, match="C-contiguous"):
        lonely[0].allreduce_(np.zeros((4, 4))[:, 1])
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(rr.InvalidInputError, match="read-only"):
        lonely[0].broadcast_(ro, root_rank=0)


@pytest.mark.parametrize("call", ["allreduce", "allreduce_", "allreduce_async_"])
def test_byte_order_must_be_native(lonely, call):
    # A big-endian float32 must not be summed as if it were little-endian.
    with pytest.raises(rr.InvalidInputError, match="byte order"):
        getattr(lonely[0], call)(np.arange(3, dtype=np.dtype(np.float32).newbyteorder()))


def test_in_place_async_hot_path_checks(lonely):
    # allreduce_async_ checks plain arrays in C++; anything off takes the general path,
    # which raises the same errors as the blocking form.
    c = lonely[0]
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(rr.InvalidInputError, match="read-only"):
        c.allreduce_async_(ro)
    with pytest.raises(rr.InvalidInputError, match="C-contiguous"):
        c.allreduce_async_(np.zeros((4, 4), np.float32)[:, 1])
    # The C++ hot paths hand these over; 1.0 and 1+0j hash like Average.
    for op in (17, -1, 2**40, None, "sum", 1.5, 1.0, np.float64(1.0), 1 + 0j):
        with pytest.raises(rr.InvalidInputError, match="op must be one of"):
            c.allreduce_async_(np.zeros(3, np.float32), op=op)
        with pytest.raises(rr.InvalidInputError, match="op must be one of"):
            c.grouped_allreduce_async_([np.zeros(3, np.float32)], op=op)
        with pytest.raises(rr.InvalidInputError, match="op must be one of"):
            c.reducescatter_async(np.zeros(4, np.float32), op=op)
    with pytest.raises(rr.InvalidInputError, match="complex128 is not supported"):
        c.allreduce_async_(np.zeros(3, np.complex128))
    with pytest.raises(rr.InvalidInputError, match="not supported for dtype bool"):
        c.allreduce_async_(np.zeros(3, bool), op=rr.Average)
    # Errors name the call the user made, in place or not.
    for call, label in ((c.allreduce_async_, "allreduce_ 'g'"),
                        (c.allreduce_async, "allreduce 'g'")):
        with pytest.raises(rr.InvalidInputError, match=label):
            call(np.zeros(3, np.complex128), name="g")
        with pytest.raises(rr.InvalidInputError, match=label):
            call(np.zeros(3, np.float32), op=None, name="g")
        with pytest.raises(rr.InvalidInputError, match=label):
            call(np.zeros(3, np.float32), prescale_factor=float("nan"), name="g")


class Tagged(np.ndarray):
    """An ndarray subclass (as frameworks and np.memmap make them)."""


def test_in_place_async_takes_every_plain_input(pair):
    def body(c):
        r = c.rank()
        xs = [np.full(3, r + 1, np.float32).view(Tagged), np.full((2, 2), r + 1, np.int64),
              np.full(2, r + 1, np.float16), np.full(1, r + 1, np.uint8)]
        # Names need not be strings (they become str(name)), and may be absent.
        hs = [c.allreduce_async_(x, op=rr.Sum, name=i if i % 2 else None)
              for i, x in enumerate(xs)]
        return [rr.synchronize(h) for h in hs], xs

    for out, xs in both(pair, body):
        for got, x in zip(out, xs):
            assert got is x
            np.testing.assert_array_equal(x, np.full(x.shape, 3))


@pytest.mark.parametrize("bad", ["2", None, float("nan"), float("inf"), 2**2000, [1.0]])
def test_scale_factors_must_be_finite_numbers(lonely, bad):
    """Every path that takes scale factors (the C++ hot paths hand odd ones over); async
    forms only, so that a call that wrongly went through cannot block this test."""
    c = lonely[0]
    calls = [
        lambda kw: c.allreduce_async_(np.ones(3, np.float32), **kw),
        lambda kw: c.allreduce_async(np.ones(3, np.float32), **kw),
        lambda kw: c.grouped_allreduce_async_([np.ones(3, np.float32)], **kw),
        lambda kw: c.grouped_allreduce_async([np.ones(3, np.float32)], **kw),
        lambda kw: c.reducescatter_async(np.ones(4, np.float32), **kw),
    ]
    for call in calls:
        for kw in ({"prescale_factor": bad}, {"postscale_factor": bad}):
            with pytest.raises(rr.InvalidInputError, match="must be finite real numbers"):
                call(kw)


def test_local_argument_errors(lonely):
    """Each error names the rank and the call made (in Python's checks, as in the core's)."""
    c = lonely[0]
    for call in (c.broadcast, c.broadcast_):
        with pytest.raises(rr.InvalidInputError, match="root_rank must be an int in") as err:
            call(np.zeros(3), root_rank=2)
        assert str(err.value).startswith(f"rank 0: {call.__name__}: "), err.value
    with pytest.raises(rr.InvalidInputError, match="^rank 0: broadcast_object 'o': root_rank"):
        c.broadcast_object({"a": 1}, root_rank=2, name="o")
    for match, call in (
            ("op must be one of", lambda: c.allreduce(np.zeros(3), op=17)),
            ("not supported for dtype bool",
             lambda: c.allreduce(np.zeros(3, bool), op=rr.Average)),
            ("not defined for dtype bool",
             lambda: c.allreduce(np.zeros(3, bool), op=rr.Max, postscale_factor=2.0)),
            ("0-d scalar", lambda: c.allgather(np.float32(1.0))),
            ("summing to dim 0", lambda: c.alltoall(np.zeros(4), splits=[1, 1])),
            ("does not divide", lambda: c.alltoall(np.zeros(3))),
            ("needs at least one array", lambda: c.grouped_allreduce([]))):
        with pytest.raises(rr.InvalidInputError, match=match) as err:
            call()
        assert str(err.value).startswith("rank 0: "), err.value


def test_zero_size_arrays(pair):
    def body(c):
        return (c.allreduce(np.zeros((0, 3), np.float32)), c.allgather(np.zeros((0, 2))),
                c.broadcast(np.zeros(0, np.int8), root_rank=1))

    for a, g, b in both(pair, body):
        assert a.shape == (0, 3) and g.shape == (0, 2) and b.shape == (0,)


# Different names are different tensors, not a mismatch: that case stalls
# (tests/test_engine.py covers the stall inspector).
@pytest.mark.parametrize("call", ["shape", "dtype", "op", "root", "kind"])
def test_mismatch_raises_on_every_rank_then_recovers(pair, call):
    def body(c):
        r = c.rank()
        x = np.ones(10 + (r if call == "shape" else 0),
                    np.float64 if call == "dtype" and r else np.float32)
        if call == "root":
            c.broadcast(x, root_rank=r)
        elif call == "kind" and r:
            c.barrier()
        else:
            c.allreduce(x, op=rr.Max if call == "op" and r else rr.Sum)

    errs = both(pair, body)
    for e in errs:
        assert isinstance(e, rr.MismatchError), e
        assert "rank 0 called" in str(e) and "rank 1 called" in str(e)
    if call == "shape":
        assert "float32[10]" in str(errs[0]) and "float32[11]" in str(errs[0])
    ok = both(pair, lambda c: c.allreduce(np.full(3, c.rank(), np.float32), op=rr.Sum))
    assert all((o == 1).all() for o in ok)


@pytest.mark.parametrize("case", ["python-check", "core-check", "unnamed", "grouped"])
def test_call_refused_on_one_rank_fails_the_others_at_once(pair, case):
    """Rank 1's call fails its own checks (in Python, or in the core's submit) and its
    caller goes on; rank 0's matching call must raise at once naming rank 1 and the
    reason, not wait for rank 1 forever. Later calls (unnamed too) still line up."""
    def body(c):
        bad = c.rank() == 1
        if case == "python-check":
            return c.broadcast(np.ones(3), root_rank=5 if bad else 0, name="refused-py")
        if case == "core-check":
            return c.allreduce(np.zeros(3, bool), op=rr.Average if bad else rr.Max,
                               name="refused-core")
        if case == "grouped":  # unnamed: every member's name is refused, and the next one
            return c.grouped_allreduce([np.ones(3), np.ones(2)],  # lines up again
                                       op=99 if bad else rr.Sum)
        return c.allreduce(np.ones(3), op=99 if bad else rr.Sum)

    errs = both(pair, body)
    assert isinstance(errs[1], rr.InvalidInputError), errs
    assert isinstance(errs[0], rr.MismatchError), errs
    assert "rank 1 refused this call locally" in str(errs[0]), errs[0]
    assert str(errs[1]).split(": ")[-1] in str(errs[0]), errs  # the reason, verbatim
    ok = both(pair, lambda c: c.allreduce(np.full(3, c.rank(), np.float32), op=rr.Sum))
    assert all((o == 1).all() for o in ok), ok
    if case == "grouped":
        ok = both(pair, lambda c: c.grouped_allreduce([np.full(2, c.rank())], op=rr.Sum))
        assert all((o[0] == 1).all() for o in ok), ok


def test_use_before_init_is_clear():
    code = ("import numpy as np, ringreduce as rr\n"
            "try:\n    rr.allreduce(np.ones(2))\nexcept rr.NotInitializedError as e:\n"
            "    print('OK', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "OK ringreduce has not been initialized: call ringreduce.init()" in out.stdout, out


def test_single_process_without_launcher():
    code = ("import numpy as np, ringreduce as rr\nrr.init(); rr.init()\n"
            "assert (rr.size(), rr.rank(), rr.local_size(), rr.cross_size()) == (1, 0, 1, 1)\n"
            "assert (rr.allreduce(np.arange(3.0)) == np.arange(3.0)).all()\n"
            "assert rr.allgather(np.ones((2, 2))).shape == (2, 2)\n"
            "rr.shutdown(); rr.init(); rr.barrier(); rr.shutdown(); print('OK')\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE") and not k.startswith(("PMI", "OMPI", "HYDI"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.stdout.strip() == "OK", out


_INTERRUPT_SCRIPT = """
import os, signal, threading, time
# a background job inherits SIGINT ignored, which would drop the Ctrl-C sent below
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import ringreduce as rr
from ringreduce.testing import make_world
c0, c1 = make_world(2)
for form in ("allreduce_async_", "allreduce_async"):
    # Rank 1 has not submitted: rank 0's wait can only end by the interrupt.
    h = getattr(c0, form)(np.ones(4, np.float32), op=rr.Sum, name=form)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        h.wait()
        print(form, "not interrupted")
    except KeyboardInterrupt:
        print(form, f"interrupted after {time.monotonic() - t0:.2f} s")
    # Still in flight: once rank 1 submits, the same handle completes.
    h1 = getattr(c1, form)(np.ones(4, np.float32), op=rr.Sum, name=form)
    print(form, "result", float(h.wait()[0]), float(h1.wait()[0]))
c0.close()
c1.close()
"""


def test_ctrl_c_interrupts_a_wait_for_a_peer_that_never_comes():
    """A wait for a collective that another rank never starts must still end on Ctrl-C
    (the main thread's signal handlers run between slices of the wait)."""
    run = subprocess.run([sys.executable, "-c", _INTERRUPT_SCRIPT], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for form in ("allreduce_async_", "allreduce_async"):
        line = next(x for x in run.stdout.splitlines() if x.startswith(form + " interrupted"))
        assert float(line.split()[-2]) < 2.0, run.stdout
        assert f"{form} result 2.0 2.0" in run.stdout, run.stdout


_INTERRUPTED_BLOCKING = """
import os, signal, threading
# a background job inherits SIGINT ignored, which would drop the Ctrl-C sent below
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import ringreduce as rr
from ringreduce.testing import make_world
c0, c1 = make_world(2)
for form in ("allreduce_", "allreduce"):
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        getattr(c0, form)(np.ones(4, np.float32), op=rr.Sum, name=form)  # only it holds x
        print(form, "not interrupted")
    except KeyboardInterrupt:
        print(form, "interrupted, kept", len(c0._in_flight))
    kept = c0._in_flight.pop()
    h1 = c1.allreduce_async_(np.ones(4, np.float32), op=rr.Sum, name=form)
    print(form, "result", float(kept.wait()[0]), float(h1.wait()[0]))
c0.close()
c1.close()
"""


def test_an_interrupted_blocking_call_keeps_its_buffer_alive():
    """A blocking allreduce_ / allreduce (submitted and waited for in one C++ call, with
    no handle kept) interrupted by Ctrl-C hands its handle, and with it the arrays the
    collective still uses, to the communicator's list of calls in flight."""
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED_BLOCKING], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for form in ("allreduce_", "allreduce"):
        assert f"{form} interrupted, kept 1" in run.stdout, run.stdout
        assert f"{form} result 2.0 2.0" in run.stdout, run.stdout


_INTERRUPTED_JOIN = """
import os, signal, threading, time
# a background job inherits SIGINT ignored, which would drop the Ctrl-C sent below
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
from ringreduce.testing import make_world
c0, c1 = make_world(2)
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()


def rank1():
    time.sleep(1.0)
    c1.join()
    print("rank 1 group", float(c1.grouped_allreduce_async([np.ones(2)]).wait()[0][0]),
          flush=True)


t = threading.Thread(target=rank1, daemon=True)
t.start()
try:
    c0.join()
except KeyboardInterrupt:
    print("rank 0 interrupted in join", flush=True)
time.sleep(1.5)  # rank 1's join completes the join in rank 0's engine too
h = c0.grouped_allreduce_async([np.ones(2)])
t.join(10)
deadline = time.monotonic() + 10  # rank 1's result came first: give rank 0's engine time
while not h.done() and time.monotonic() < deadline:
    time.sleep(0.01)
print("rank 0 group", float(h.wait()[0][0]) if h.done() else "stuck", flush=True)
os._exit(0)
"""


def test_unnamed_groups_still_match_after_an_interrupted_join():
    """A join() interrupted by Ctrl-C still completes in the engine when the others join;
    the names of later unnamed groups must follow the engine's count of joins."""
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED_JOIN], capture_output=True,
                         text=True, timeout=60)
    assert "rank 0 interrupted in join" in run.stdout, (run.stdout, run.stderr[-1000:])
    assert "rank 0 group 1.0" in run.stdout and "rank 1 group 1.0" in run.stdout, run.stdout
