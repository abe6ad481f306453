"""The autotuner (csrc/coordination/autotuner.h, bayes_opt.h; RINGREDUCE_AUTOTUNE, Horovod's
HOROVOD_AUTOTUNE): the Bayesian optimizer on known functions, the tuner's trials and choice on
a simulated clock, and ranks (threads, then processes under mpirun with Horovod's variables)
that tune together, agree on every setting and keep their results right meanwhile."""

from __future__ import annotations

import csv
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import env
from procs import PYTHON, base_env, require_mpirun, run_procs

import ringreduce as rr
from ringreduce import _core
from ringreduce.testing import make_world, run_threaded

co = _core.coordination
WORKER = str(Path(__file__).parent / "workers" / "launcher_worker.py")
HEADER = ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
          "cycle_time_ms", "tensor_fusion_threshold", "score", "batch_us"]  # Horovod's, then ours


def read_log(path):
    """The log's rows as [hierarchical, allgather, cycle, fusion, score, batch] (after checking
    Horovod's header and its columns ringreduce has no knob for)."""
    rows = list(csv.reader(path.open()))
    assert rows[0] == HEADER
    assert all(r[2] == "0" and r[3] == "1" for r in rows[1:])  # no torus; the cache is on
    return [rows[0]] + [[r[0], r[1], r[4], r[5], r[6], r[7]] for r in rows[1:]]


def peak(x):  # maximum 0 at (0.7, 0.2)
    return -((x[0] - 0.7) ** 2 + (x[1] - 0.2) ** 2)


def test_bayes_opt_finds_the_peak_of_a_smooth_function():
    bo = co.BayesOpt(2, 1e-4)
    for x in ([0.5, 0.5], [0.1, 0.9], [0.9, 0.1], [0.3, 0.3]):
        bo.add(x, peak(x))
    best = max(peak(x) for x in ([0.5, 0.5], [0.1, 0.9], [0.9, 0.1], [0.3, 0.3]))
    for _ in range(16):
        x = bo.next()
        assert all(0.0 <= v <= 1.0 for v in x)
        bo.add(x, peak(x))
        best = max(best, peak(x))
    assert best > -0.01  # within 0.1 of the peak; the start's best was -0.05
    mean, sd = bo.predict([0.5, 0.5])
    assert abs(mean - peak([0.5, 0.5])) < 0.01 and sd < 0.05  # it interpolates its samples
    assert bo.samples == 20


def test_bayes_opt_is_reproducible_and_starts_at_the_centre():
    def run(seed=7):
        bo = co.BayesOpt(3, 0.8, seed)
        first = bo.next()
        out = []
        for i in range(6):
            x = bo.next()
            bo.add(x, math.sin(3 * x[0]) + x[1] - x[2] + 0.1 * i)
            out.append(x)
        return first, out

    a, b = run(), run()
    assert a == b and a[0] == [0.5, 0.5, 0.5]
    assert run(8)[1] != a[1]  # the candidates are random: another seed, other choices


def step_seconds(t):
    """A made-up job whose step is fastest at a 16 MiB threshold, no cycle time, 800 us gap,
    with the hierarchical allreduce forced off (hierarchical: -1 automatic, 0 off, 1 on)."""
    return (0.010 + 0.001 * abs(math.log2(t["fusion_mb"]) - 4) + 0.002 * t["cycle_ms"]
            + 0.000004 * abs(t["batch_us"] - 800) + {-1: 0.001, 0: 0, 1: 0.002}[t["hierarchical"]])


def simulate(options, start, hierarchical=False, steps=2000, cost=step_seconds):
    """Feed an Autotuner steps of four 1 MiB tensors on a clock that cost() advances; returns
    the tuner, the settings each step ran with, and the log's rows."""
    log = Path(tempfile.mkdtemp(prefix="rr-at-")) / "autotune.csv"
    tuner = co.Autotuner({**options, "log_path": str(log)}, start, hierarchical)
    now, ran = 0.0, []
    tensors = [{"name": f"t{i}", "shape": [1 << 18]} for i in range(4)]  # float32: 1 MiB
    for _ in range(steps):
        for t in tensors:
            if tuner.observe([t], now):
                tuner.adopt(tuner.decide(), now)
        ran.append(tuner.current)
        now += cost(tuner.current)
    return tuner, ran, read_log(log)


START = {"fusion_mb": 256.0, "cycle_ms": 0.0, "batch_us": 50.0, "hierarchical": -1.0}


def duels(trials):
    """The duels after the Bayesian trials: (incumbent, challenger, the four scores)."""
    out = []
    for i in range(0, len(trials), 4):
        a, b, c, d = trials[i:i + 4]
        knobs = [r[:4] + r[5:] for r in (a, b, c, d)]
        assert knobs[0] == knobs[3] and knobs[1] == knobs[2], (a, b, c, d)  # I, C, C, I
        out.append((knobs[0], knobs[1], [a[4], b[4], c[4], d[4]]))
    return out


def test_tuner_scores_trials_then_keeps_the_best():
    opts = {"warmup_samples": 2, "steps_per_sample": 4, "bayes_opt_max_samples": 12,
            "gp_noise": 0.01}
    tuner, ran, rows = simulate(opts, START)
    final = tuner.current
    assert final["active"] == 0 and final["trials"] == 12 + 4
    assert len(rows) == 1 + 12 + 4 + 1  # header, trials, a duel, choice
    trials = [[float(v) for v in r] for r in rows[1:-1]]
    # each trial ran 5 samples of 4 steps: 20 steps; the two warmup trials came first
    assert all(r["fusion_mb"] == 256.0 and r["batch_us"] == 50.0 for r in ran[:3 * 20])
    assert trials[0][2:4] == [0.0, 256.0] and trials[0][5] == 50.0  # the start is measured
    for r in trials:  # a score is bytes per microsecond of the simulated clock
        t = {"fusion_mb": r[3], "cycle_ms": r[2], "batch_us": r[5], "hierarchical": -1}
        assert r[4] == pytest.approx(4 * (1 << 20) / step_seconds(t) / 1e6, rel=1e-6)
    # The model's favourite (on this noiseless clock, the best trial) duels the start, wins,
    # and is the choice, written last with its duel score.
    [(incumbent, challenger, scores)] = duels(trials[12:])
    best = max(trials[:12], key=lambda r: r[4])
    assert incumbent == trials[0][:4] + trials[0][5:] and challenger == best[:4] + best[5:]
    choice = [float(v) for v in rows[-1]]
    assert choice[:4] + choice[5:] == challenger
    assert choice[4] == pytest.approx((scores[1] + scores[2]) / 2)
    assert [final["cycle_ms"], final["fusion_mb"], final["batch_us"]] == pytest.approx(
        [best[2], best[3], best[5]], rel=1e-8)
    assert step_seconds(final) < 0.8 * step_seconds(START)  # it found a faster setting
    assert all(r == final for r in ran[-100:])  # and kept it


def test_knobs_the_user_set_stay_and_hierarchical_is_tried_both_ways():
    opts = {"warmup_samples": 0, "steps_per_sample": 2, "bayes_opt_max_samples": 6,
            "fixed_cycle": True, "fixed_fusion": True}
    start = {**START, "cycle_ms": 1.5}
    tuner, ran, rows = simulate(opts, start, hierarchical=True, steps=1200)
    assert {(r["cycle_ms"], r["fusion_mb"]) for r in ran} == {(1.5, 256.0)}
    trials = [[float(v) for v in r] for r in rows[1:-1]]
    assert [r[0] for r in trials[:6]] == [-1] * 6
    fought = duels(trials[6:])
    # maybe the favourite first; then the incumbent with the hierarchical allreduce forced
    # off (it wins: cheaper in step_seconds), then that one forced on (it loses)
    assert [(i[0], c[0]) for i, c, _ in fought[-2:]] == [(-1, 0), (0, 1)]
    final = tuner.current
    assert final["hierarchical"] == 0.0 and final["active"] == 0
    assert float(rows[-1][0]) == 0
    assert len({r["batch_us"] for r in ran}) > 2  # the free knob moved


def test_nothing_to_tune_when_every_knob_is_the_users():
    opts = {"fixed_cycle": True, "fixed_fusion": True, "fixed_batch": True}
    tuner, ran, rows = simulate(opts, START, steps=50)
    assert tuner.current["active"] == 0 and rows == [HEADER]
    assert all(r == ran[0] for r in ran)


def tune_in_threads(n, hosts=None, steps=300, **settings):
    log = Path(tempfile.mkdtemp(prefix="rr-at-")) / "autotune.csv"
    base = {"RINGREDUCE_AUTOTUNE": "1", "RINGREDUCE_AUTOTUNE_LOG": str(log),
            "RINGREDUCE_AUTOTUNE_WARMUP_SAMPLES": "1", "RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE": "2",
            "RINGREDUCE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5", "RINGREDUCE_SMALL_BYTES": "0"}
    with env(**{**base, **settings}):
        comms = make_world(n, hosts)
    sizes = (3, 1000, 40000)

    def body(c):
        xs = [np.arange(k, dtype=np.float64) * (c.rank() + 1) for k in sizes]
        wrong = 0
        for _ in range(steps):
            hs = [c.allreduce_async(x, op=rr.Sum, name=f"g{i}") for i, x in enumerate(xs)]
            for h, k in zip(hs, sizes):
                wrong += not np.array_equal(h.wait(), np.arange(k) * n * (n + 1) / 2)
        return wrong, c._engine.stats()

    try:
        out = run_threaded(n, body, world=comms)
    finally:
        for c in comms:
            c.close()
    return out, read_log(log)


KNOBS = ("autotuning", "autotune_trials", "fusion_threshold", "cycle_time_ms", "batch_us",
         "hierarchical")


@pytest.mark.parametrize("n", [2, 3])  # 2: paired rounds, where no RESPONSES message goes
def test_threaded_ranks_tune_together_and_stay_right(n):
    out, rows = tune_in_threads(n)
    assert [w for w, _ in out] == [0] * n
    knobs = [{k: s[k] for k in KNOBS} for _, s in out]
    assert knobs == [knobs[0]] * n, knobs
    # 5 trials, 4 more if the model's favourite dueled the start (possible on a noisy clock)
    assert knobs[0]["autotuning"] is False and knobs[0]["autotune_trials"] in (5, 9)
    assert len(rows) == 1 + knobs[0]["autotune_trials"] + 1
    assert float(rows[-1][5]) == pytest.approx(knobs[0]["batch_us"])
    assert float(rows[-1][3]) * (1 << 20) == pytest.approx(knobs[0]["fusion_threshold"], rel=1e-8)


def test_threaded_hosts_tune_the_hierarchical_allreduce():
    out, rows = tune_in_threads(4, hosts=["a", "a", "b", "b"], steps=400,
                                RINGREDUCE_CYCLE_TIME_MS="0")
    assert [w for w, _ in out] == [0] * 4
    knobs = [{k: s[k] for k in KNOBS} for _, s in out]
    assert knobs == [knobs[0]] * 4 and knobs[0]["autotune_trials"] in (13, 17)
    trials = [[float(v) for v in r] for r in rows[1:-1]]
    assert [r[0] for r in trials[:5]] == [-1] * 5
    fought = duels(trials[5:])  # maybe the favourite, then forced off and forced on
    assert [c[0] for _, c, _ in fought[-2:]] == [0, 1]
    assert {r[2] for r in rows[1:]} == {"0"}  # the cycle time was the user's
    assert all(s["hierarchical_allreduces"] > 0 for _, s in out)


def test_horovod_autotune_under_mpirun(tmp_path):
    mpirun = require_mpirun()
    log_dir = Path(tempfile.mkdtemp(prefix="rr-at-mpi-"))
    genv = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(tmp_path / "at.csv"),
            "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
            "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "4", "HOROVOD_FUSION_THRESHOLD": "1048576"}
    args = [a for k, v in genv.items() for a in ("-genv", k, v)]
    job = run_procs([("mpirun", [str(mpirun), "-np", "2", *args, PYTHON, WORKER, "autotune"],
                      base_env(None, log_dir))], 60, log_dir)
    proc = job.procs[0]
    assert proc.returncode == 0, job.describe()
    got = dict(re.findall(r"autotune (\d) (\{[^}]*\})", proc.stdout))  # lines may interleave
    assert sorted(got) == ["0", "1"] and got["0"] == got["1"], job.describe()
    assert re.search(r"'autotuning': False, 'autotune_trials': [48], 'fusion_threshold': 1048576",
                     got["0"]), got  # 4 trials, 4 more if a favourite dueled the start
    rows = read_log(tmp_path / "at.csv")
    assert len(rows) in (6, 10)
    assert {r[3] for r in rows[1:]} == {"1"}  # HOROVOD_FUSION_THRESHOLD held it at 1 MiB


@pytest.mark.parametrize("rank0, rank1, shown", [
    ({"RINGREDUCE_AUTOTUNE": "1"}, {}, ("AUTOTUNE=10:---- ", "AUTOTUNE=0 ")),
    # the same steps, but rank 0 holds the cycle time: it would tune other knobs
    ({"RINGREDUCE_AUTOTUNE": "1", "RINGREDUCE_CYCLE_TIME_MS": "0"}, {"RINGREDUCE_AUTOTUNE": "1"},
     ("AUTOTUNE=10:-c--", "AUTOTUNE=10:----")),
    # the allgather algorithm is each rank's own choice: they must agree on it
    ({"RINGREDUCE_HIERARCHICAL_ALLGATHER": "1"}, {},
     ("HIERARCHICAL_ALLGATHER=1'", "HIERARCHICAL_ALLGATHER=0'")),
])
def test_ranks_that_disagree_on_autotune_fail_at_init_naming_it(rank0, rank1, shown):
    mpirun = require_mpirun()
    log_dir = Path(tempfile.mkdtemp(prefix="rr-at-mpi-"))

    def one(env):
        return ["-np", "1", *[a for k, v in env.items() for a in ("-env", k, v)], PYTHON,
                WORKER, "autotune"]

    job = run_procs([("mpirun", [str(mpirun), *one(rank0), ":", *one(rank1)],
                      base_env(None, log_dir))], 60, log_dir)
    out = job.procs[0].stdout
    assert job.procs[0].returncode != 0, job.describe()
    for rank in (0, 1):  # both ranks raise, each line showing every rank's value
        line = next((ln for ln in out.splitlines() if ln.startswith(f"error {rank} ")), "")
        assert line.startswith(f"error {rank} MismatchError: rank {rank}:"), job.describe()
        assert all(s in line for s in shown), job.describe()


def test_names_that_stop_repeating_end_tuning_with_the_start_restored():
    # a few named steps move the settings to a test point, then only new names come
    tuner = co.Autotuner({"steps_per_sample": 1, "warmup_samples": 0}, START)
    now = 0.0
    for _ in range(12):
        now += 0.01
        if tuner.observe([{"name": "g"}], now):
            tuner.adopt(tuner.decide(), now)
    assert tuner.current["active"] == 1 and tuner.current["fusion_mb"] != 256.0
    ended = [i for i in range(100001) if tuner.observe([{"name": f"noname.{i}"}], now + i)]
    assert len(ended) == 1 and ended[0] >= 99999  # by names only: alike on every rank
    final = tuner.decide()  # rank 0's, which the engine broadcasts
    assert final["active"] == 0 and final["trials"] == 2
    assert [final[k] for k in ("fusion_mb", "cycle_ms", "batch_us")] == [256.0, 0.0, 50.0]
    tuner.adopt(final, now)
    assert not tuner.observe([{"name": "g"}] * 3, now)


def test_the_negotiator_fuses_up_to_the_threshold_it_was_given_last():
    n = co.Negotiator(1, fusion_threshold=1 << 20)

    def fused(threshold):
        n.set_fusion_threshold(threshold)
        for i in range(4):
            n.submit(0, {"name": f"t{i}", "shape": [1 << 16]}, 0.0)  # 256 KiB each
        return [len(r["tensors"]) for r in n.decide(0.0)]

    assert fused(1 << 20) == [4]
    assert fused(512 << 10) == [2, 2]


def test_a_flat_noisy_landscape_keeps_the_start():
    kept = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)

        def noisy(t, rng=rng):  # no knob matters; each step varies by +-10%
            return 0.010 * (1 + 0.1 * rng.standard_normal())

        opts = {"warmup_samples": 0, "steps_per_sample": 3, "bayes_opt_max_samples": 10}
        tuner, _, rows = simulate(opts, START, steps=1500, cost=noisy)
        final = tuner.current
        assert final["active"] == 0
        kept += [final[k] for k in ("fusion_mb", "cycle_ms", "batch_us")] == [256.0, 0.0, 50.0]
    assert kept >= 9  # an equal challenger that duels passes one time in four
