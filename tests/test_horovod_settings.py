"""Horovod's settings: ``HOROVOD_*`` variables at ``init()`` and ``horovodrun``'s flags on
``ringrun`` (``ringreduce/_horovod_settings.py``, ``ringreduce/_horovodrun.py``).

In one process: the conversion table, precedence, the config file, refusals. Launched (hard
timeouts, tests/procs.py): a horovodrun command line under ringrun, and Horovod variables
passed through ``mpirun -genv`` taking effect in the core (timeline, stall shutdown).
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
import threading
from pathlib import Path

import pytest
from procs import PYTHON, WORKERS, base_env, require_mpirun, run_procs

import ringreduce as rr
from ringreduce import _horovod_settings as hs
from ringreduce import _horovodrun, launcher

WORKER = str(WORKERS / "launcher_worker.py")
RINGRUN = [PYTHON, "-m", "ringreduce"]
SETTINGS_LINE = re.compile(r"^(?:\S.*?)?\[(\d+)\]: settings (\{.*\}) sum ([\d.]+)$", re.M)

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------- one process
def test_horovod_variables_convert_to_ringreduce_settings():
    got = hs.translate(
        {
            "HOROVOD_FUSION_THRESHOLD": "33554432",
            "HOROVOD_CYCLE_TIME": "3.5",
            "HOROVOD_CACHE_CAPACITY": "0",
            "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
            "HOROVOD_TIMELINE": "/tmp/t.json",
            "HOROVOD_LOG_LEVEL": "TRACE",
            "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
            "HOROVOD_GLOO_TIMEOUT_SECONDS": "90",
            "HOROVOD_GLOO_IFACE": "eth1",
            "HOROVOD_DYNAMIC_PROCESS_SETS": "true",
            "HOROVOD_RANK": "3",
        }
    )
    assert got == {
        "RINGREDUCE_FUSION_THRESHOLD": "33554432",
        "RINGREDUCE_CYCLE_TIME_MS": "3.5",
        "RINGREDUCE_CACHE_CAPACITY": "0",
        "RINGREDUCE_HIERARCHICAL_ALLREDUCE": "1",
        "RINGREDUCE_TIMELINE": "/tmp/t.json",
        "RINGREDUCE_LOG_LEVEL": "debug",
        "RINGREDUCE_STALL_CHECK_SECONDS": "30.0",
        "RINGREDUCE_STALL_SHUTDOWN_SECONDS": "120.0",
        "RINGREDUCE_CONNECT_TIMEOUT_SECONDS": "90.0",
        "RINGREDUCE_IFACE": "eth1",
        "RINGREDUCE_DYNAMIC_PROCESS_SETS": "1",
    }
    # A disabled stall check wins over a stall time, as in Horovod; DYNAMIC opens no file.
    assert hs.translate(
        {
            "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
            "HOROVOD_STALL_CHECK_DISABLE": "1",
            "HOROVOD_TIMELINE": "DYNAMIC",
            "HOROVOD_LOG_LEVEL": "fatal",
        }
    ) == {
        "RINGREDUCE_STALL_CHECK_SECONDS": "0",
        "RINGREDUCE_TIMELINE": "",
        "RINGREDUCE_LOG_LEVEL": "error",
    }
    assert hs.translate(
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_CHECK_DISABLE": "0"}
    ) == {"RINGREDUCE_STALL_CHECK_SECONDS": "30.0"}


@pytest.mark.parametrize(
    "name,value",
    [
        ("HOROVOD_FUSION_THRESHOLD", "64MB"),
        ("HOROVOD_CYCLE_TIME", "-1"),
        ("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe"),
        ("HOROVOD_LOG_LEVEL", "loud"),
    ],
)
def test_a_bad_horovod_value_names_the_variable(name, value):
    with pytest.raises(rr.InvalidInputError, match=f"{name}={value!r}"):
        hs.translate({name: value})


def test_explicit_ringreduce_settings_win_and_a_later_init_recomputes():
    env = {
        "HOROVOD_FUSION_THRESHOLD": "1024",
        "HOROVOD_CYCLE_TIME": "2",
        "RINGREDUCE_CYCLE_TIME_MS": "7",
    }
    assert hs.apply_to_environ(env) == {"RINGREDUCE_FUSION_THRESHOLD": "1024"}
    assert env["RINGREDUCE_CYCLE_TIME_MS"] == "7"  # the user's own setting
    assert env["RINGREDUCE_FROM_HOROVOD"] == "RINGREDUCE_FUSION_THRESHOLD"
    env["HOROVOD_FUSION_THRESHOLD"] = "2048"  # changed before an elastic reset's init()
    hs.apply_to_environ(env)
    assert env["RINGREDUCE_FUSION_THRESHOLD"] == "2048"
    del env["HOROVOD_FUSION_THRESHOLD"]
    assert hs.apply_to_environ(env) == {}
    assert "RINGREDUCE_FUSION_THRESHOLD" not in env and "RINGREDUCE_FROM_HOROVOD" not in env


def test_elastic_timeout_comes_from_the_flag_then_horovods_variable(monkeypatch):
    assert hs.elastic_timeout(None, {}) == 600.0
    assert hs.elastic_timeout(None, {"HOROVOD_ELASTIC_TIMEOUT": "30"}) == 30.0
    assert hs.elastic_timeout(5.0, {"HOROVOD_ELASTIC_TIMEOUT": "30"}) == 5.0
    with pytest.raises(rr.InvalidInputError, match="HOROVOD_ELASTIC_TIMEOUT='soon'"):
        hs.elastic_timeout(None, {"HOROVOD_ELASTIC_TIMEOUT": "soon"})
    # the variable is not a flag: a fixed-size job with it set is no usage error
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "30")
    assert launcher.main(["-np", "1", PYTHON, "-c", "pass"]) == 0


def test_knobs_without_effect_are_named_once_on_rank_0(capsys, monkeypatch):
    monkeypatch.setattr(hs, "_warned", set())
    env = {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "x.csv",
        "HOROVOD_NUM_NCCL_STREAMS": "2",
        "HOROVOD_MPI_THREADS_DISABLE": "0",
        "HOROVOD_RANK": "1",
    }
    assert hs.no_effect(env) == ["HOROVOD_NUM_NCCL_STREAMS"]  # the autotuner is real
    assert hs.translate(env) == {"RINGREDUCE_AUTOTUNE": "1", "RINGREDUCE_AUTOTUNE_LOG": "x.csv"}
    hs.warn_no_effect(env, rank=1)
    hs.warn_no_effect({**env, "RINGREDUCE_LOG_LEVEL": "ERROR"}, rank=0)
    assert capsys.readouterr().err == ""
    hs.warn_no_effect(env, rank=0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HOROVOD_NUM_NCCL_STREAMS (the GPU backend" in err
    hs.warn_no_effect(env, rank=0)  # an elastic reset's init(): told once already
    assert capsys.readouterr().err == ""


def test_start_timeouts_take_the_longer_and_the_users_own_setting_wins(monkeypatch):
    both = {"HOROVOD_START_TIMEOUT": "120", "HOROVOD_GLOO_TIMEOUT_SECONDS": "45"}
    assert hs.translate(both) == {"RINGREDUCE_CONNECT_TIMEOUT_SECONDS": "120.0"}
    env = {**both, "RINGREDUCE_CONNECT_TIMEOUT_SECONDS": "5"}
    assert hs.apply_to_environ(env) == {} and env["RINGREDUCE_CONNECT_TIMEOUT_SECONDS"] == "5"
    # an exported HOROVOD_START_TIMEOUT is left to each rank's init(); the flag is explicit
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "300")
    assert _flags("--start-timeout", "10").rank_env == {
        "RINGREDUCE_CONNECT_TIMEOUT_SECONDS": "10.0"}
    assert _flags().rank_env == {}


def test_horovod_spellings_read_as_horovod_reads_them():
    assert hs.translate({"HOROVOD_LOG_LEVEL": "warn", "HOROVOD_HIERARCHICAL_ALLREDUCE": "2",
                         "HOROVOD_FUSION_THRESHOLD": ""}) == {
        "RINGREDUCE_LOG_LEVEL": "warning", "RINGREDUCE_HIERARCHICAL_ALLREDUCE": "1"}
    with pytest.raises(rr.InvalidInputError, match="HOROVOD_CYCLE_TIME='nan'"):
        hs.translate({"HOROVOD_CYCLE_TIME": "nan"})


def test_the_launchers_own_horovod_conversions_are_not_handed_on(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_FROM_HOROVOD", "RINGREDUCE_CYCLE_TIME_MS")
    monkeypatch.setenv("RINGREDUCE_CYCLE_TIME_MS", "3")
    monkeypatch.setenv("RINGREDUCE_CACHE_CAPACITY", "7")
    env = launcher._scrubbed_env(os.environ)
    assert "RINGREDUCE_CYCLE_TIME_MS" not in env and "RINGREDUCE_FROM_HOROVOD" not in env
    assert env["RINGREDUCE_CACHE_CAPACITY"] == "7"


def _pumped(lines: bytes, prefix: bytes, stamp: bool, copy=None) -> list:
    read, write = os.pipe()
    os.write(write, lines)
    os.close(write)
    got: list = []
    launcher._pump(os.fdopen(read, "rb"), got.append, prefix, threading.Lock(), copy, stamp)
    return got


def test_timestamps_as_horovodrun_writes_them_and_a_failing_copy_stops_nothing(capsys):
    stamp = rb"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    got = _pumped(b"hello\n", b"", True)
    assert re.fullmatch(stamp + rb" hello\n", got[0]), got  # a space when no prefix
    copy = io.BytesIO()
    copy.close = lambda: None  # read below
    got = _pumped(b"a\nb\n", b"[1]: ", True, copy)
    assert all(re.fullmatch(stamp + rb"\[1\]: [ab]\n", g) for g in got), got
    assert re.fullmatch(stamp + rb" a\n" + stamp + rb" b\n", copy.getvalue())

    class Full(io.BytesIO):
        name = "out/rank.1/stdout"

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    assert _pumped(b"a\nb\n", b"", False, Full()) == [b"a\n", b"b\n"]
    err = capsys.readouterr().err
    assert err.count("cannot write out/rank.1/stdout") == 1, err


def _flags(*argv: str) -> object:
    a = launcher._parser().parse_args([*argv, "python", "t.py"])
    launcher._horovod_flags(a)
    return a


def test_horovodrun_flags_become_every_ranks_settings(capsys):
    a = _flags(
        "--fusion-threshold-mb",
        "32",
        "--cycle-time-ms",
        "2.5",
        "--cache-capacity",
        "512",
        "--no-hierarchical-allreduce",
        "--timeline-filename",
        "t.json",
        "--timeline-mark-cycles",
        "--no-stall-check",
        "--stall-check-shutdown-time-seconds",
        "300",
        "--log-level",
        "info",
        "--start-timeout",
        "120",
        "--gloo-timeout-seconds",
        "45",
        "--network-interface",
        "eth1",
        "--tcp",
        "--autotune",
        "--autotune-log-file",
        "at.csv",
        "--autotune-steps-per-sample",
        "4",
        "--autotune-gaussian-process-noise",
        "0.5",
        "--num-nccl-streams",
        "2",
        "-x",
        "RINGREDUCE_CACHE_CAPACITY=9",
        "-p",
        "2222",
        "-i",
        "/k/id",
    )
    assert a.rank_env == {
        "RINGREDUCE_FUSION_THRESHOLD": str(32 << 20),
        "RINGREDUCE_CYCLE_TIME_MS": "2.5",
        "RINGREDUCE_CACHE_CAPACITY": "9",
        "RINGREDUCE_HIERARCHICAL_ALLREDUCE": "0",
        "RINGREDUCE_TIMELINE": "t.json",
        "RINGREDUCE_STALL_CHECK_SECONDS": "0",
        "RINGREDUCE_STALL_SHUTDOWN_SECONDS": "300.0",
        "RINGREDUCE_LOG_LEVEL": "info",
        "RINGREDUCE_CONNECT_TIMEOUT_SECONDS": "120.0",
        "RINGREDUCE_IFACE": "eth1",
        "NCCL_IB_DISABLE": "1",
        "RINGREDUCE_TIMELINE_MARK_CYCLES": "1",
        "RINGREDUCE_AUTOTUNE": "1",
        "RINGREDUCE_AUTOTUNE_LOG": "at.csv",
        "RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "RINGREDUCE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
    }
    assert "--num-nccl-streams: no effect" in capsys.readouterr().err
    argv = launcher._ssh_argv(a.ssh_command, a.ssh_port, "far", "true")
    assert argv[:3] == ["ssh", "-p", "2222"] and argv[-4:] == ["-i", "/k/id", "far", "true"]


def test_config_file_fills_what_the_command_line_left_out(tmp_path):
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text(
        "controller: gloo\nparams:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 4\n"
        "  hierarchical_allreduce: true\nautotune:\n  enabled: false\n"
        "  warmup_samples: 5\ntimeline:\n  filename: tl.json\nstall_check:\n"
        "  enabled: false\n  warning_time_seconds: 10\nlogging:\n  level: ERROR\n"
        "  with_timestamp: true\nlibrary_options:\n  thread_affinity: '2,3'\n"
    )
    a = _flags("--config-file", str(cfg), "--cycle-time-ms", "1")
    assert a.rank_env == {
        "RINGREDUCE_FUSION_THRESHOLD": str(16 << 20),
        "RINGREDUCE_CYCLE_TIME_MS": "1.0",
        "RINGREDUCE_HIERARCHICAL_ALLREDUCE": "1",
        "RINGREDUCE_TIMELINE": "tl.json",
        "RINGREDUCE_STALL_CHECK_SECONDS": "0",
        "RINGREDUCE_LOG_LEVEL": "error",
        "RINGREDUCE_AUTOTUNE": "0",
        "RINGREDUCE_AUTOTUNE_WARMUP_SAMPLES": "5",
        "RINGREDUCE_THREAD_AFFINITY": "2,3",
    }
    cfg.write_text("params:\n  fusion_threshold: 16\n")
    with pytest.raises(rr.InvalidInputError, match="unknown setting params.fusion_threshold"):
        _flags("--config-file", str(cfg))
    cfg.write_text("controller: mpi\n")
    with pytest.raises(rr.InvalidInputError, match="need MPI's launcher"):
        _flags("--config-file", str(cfg))
    cfg.write_text("controller:\nautotune:\nparams:\n  fusion_threshold_mb: '32'\n")
    assert _flags("--config-file", str(cfg)).rank_env == {  # empty sections as Horovod
        "RINGREDUCE_FUSION_THRESHOLD": str(32 << 20)}
    for text, match in (("params:\n  cache_capacity: lots\n", "params.cache_capacity='lots'"),
                        ("params:\n  hierarchical_allreduce: maybe\n", "true or false"),
                        ("logging:\n  level: loud\n", "expected one of"),
                        ("params: [1\n", "not YAML")):
        cfg.write_text(text)
        with pytest.raises(rr.InvalidInputError, match=match):
            _flags("--config-file", str(cfg))


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--mpi"], "need MPI's launcher"),
        (["--mpi-args=--map-by ppr:6:node"], "mpirun"),
        (["--binding-args", "x"], "mpirun"),
        (["--network-interface", "eth0,eth1"], "one interface"),
        (["--network-interface", "eth0", "--network-interface", "eth1"], "one interface"),
        (["-i", "k", "--ssh-command", "rsh"], "not both"),
    ],
)
def test_flags_that_need_another_launcher_say_what_to_run(argv, match):
    with pytest.raises(rr.InvalidInputError, match=match):
        _flags(*argv)


def test_check_build_and_version(capsys):
    assert launcher.main(["-cb"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ringreduce v{rr.__version__}:") and "[X] shared memory" in out
    assert f"[{'X' if rr.nccl_built() else ' '}] NCCL" in out
    assert launcher.main(["--version"]) == 0
    assert capsys.readouterr().out == f"ringrun {rr.__version__}\n"
    assert _horovodrun.check_build().count("\n") == out.count("\n") - 1


def test_horovod_runs_network_interface_names_one_interface():
    assert _horovodrun.run_env(None, "eth0") == {"RINGREDUCE_IFACE": "eth0"}
    with pytest.raises(rr.InvalidInputError, match="one interface"):
        _horovodrun.run_env(None, "eth0,eth1")


def test_single_dash_flags_of_horovodrun():
    a = launcher._parser().parse_args(["-np", "2", "-hostfile", "h", "-p", "22", "-cb",
                                       "python", "t.py", "-v", "-i", "x"])
    assert (a.hostfile, a.ssh_port, a.check_build) == ("h", 22, True)
    assert a.command == ["python", "t.py", "-v", "-i", "x"] and not a.version


def test_output_files_sort_in_rank_order():
    assert [launcher.padded_rank(r, 12) for r in (0, 3, 11)] == ["00", "03", "11"]
    assert launcher.padded_rank(0, 1) == "0"


# -------------------------------------------------------------------------- launched
def test_a_horovodrun_command_line_runs_under_ringrun(tmp_path):
    log_dir = Path(tempfile.mkdtemp(prefix="rr-hvdrun-"))
    argv = [
        *RINGRUN,
        "-np",
        "2",
        "--fusion-threshold-mb",
        "8",
        "--cycle-time-ms",
        "0",
        "--timeline-filename",
        "tl.json",
        "--autotune",
        "--output-filename",
        "out",
        "-prefix-timestamp",
        "--verbose",
        PYTHON,
        WORKER,
        "settings",
    ]
    job = run_procs(
        [("ringrun", argv, base_env({"HOROVOD_CACHE_CAPACITY": "64"}, log_dir))],
        30,
        log_dir,
        cwd=tmp_path,
    )
    proc = job.procs[0]
    assert proc.returncode == 0, job.describe()
    got = {int(r): (json.loads(s), float(t)) for r, s, t in SETTINGS_LINE.findall(proc.stdout)}
    assert sorted(got) == [0, 1], job.describe()
    for settings, total in got.values():
        assert total == 3
        assert settings["RINGREDUCE_FUSION_THRESHOLD"] == str(8 << 20)
        assert settings["RINGREDUCE_CYCLE_TIME_MS"] == "0.0"
        assert settings["RINGREDUCE_CACHE_CAPACITY"] == "64"  # exported, not a flag
    for line in proc.stdout.splitlines():  # horovodrun's -prefix-timestamp
        assert re.match(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[\d\]: ", line), line
    assert "no effect" not in proc.stderr  # --autotune tunes
    assert all(settings["RINGREDUCE_AUTOTUNE"] == "1" for settings, _ in got.values())
    assert "ringrun: rank 1 started on localhost (pid" in proc.stderr
    events = json.loads((tmp_path / "tl.json").read_text())
    assert any(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in events)
    for r in (0, 1):  # horovodrun's --output-filename layout: the time, no rank prefix
        out = (tmp_path / "out" / f"rank.{r}" / "stdout").read_text()
        assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \S+ \d{4} settings \{.* sum 3\n", out), out
        assert (tmp_path / "out" / f"rank.{r}" / "stderr").exists()


def test_horovod_variables_through_mpirun_take_effect(tmp_path):
    mpirun = require_mpirun()
    log_dir = Path(tempfile.mkdtemp(prefix="rr-hvdenv-"))
    genv = {
        "HOROVOD_TIMELINE": str(tmp_path / "tl.json"),
        "HOROVOD_NUM_NCCL_STREAMS": "2",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "0.5",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "1",
    }
    args = [a for k, v in genv.items() for a in ("-genv", k, v)]
    job = run_procs(
        [
            (
                "mpirun",
                [str(mpirun), "-np", "2", *args, PYTHON, WORKER, "stall"],
                base_env(None, log_dir),
            )
        ],
        40,
        log_dir,
    )
    proc = job.procs[0]
    assert proc.returncode == 0, job.describe()
    m = re.search(r"after ([\d.]+) s: RingReduceTimeoutError: (.*)", proc.stdout)
    assert m and float(m.group(1)) < 5, job.describe()
    assert "lonely" in m.group(2), job.describe()
    assert proc.stderr.count("Horovod settings without effect") == 1, job.describe()
    assert "HOROVOD_NUM_NCCL_STREAMS (the GPU backend" in proc.stderr
    assert any(
        e.get("name") == "NEGOTIATE_ALLREDUCE"
        for e in json.loads((tmp_path / "tl.json").read_text())
    )
