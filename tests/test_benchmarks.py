"""The benchmarks run: each script under mpirun at toy sizes, with a hard timeout.

They measure nothing here (timing is not asserted); what is checked is that every script
still runs against the current API, that the correctness checks the benchmarks carry pass,
and that their reports have the lines the README quotes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from procs import ROOT, Job, run_mpi, run_single

BENCH = ROOT / "benchmarks"


def stdout(job: Job) -> str:
    job.check_ok()
    return job.procs[0].stdout


def test_train_step_checks_every_implementation_and_reports_the_targets():
    out = stdout(run_mpi(2, BENCH / "train_step.py",
                         ["--scale", "0.001", "--steps", "2", "--warmup", "0",
                          "--idle-seconds", "0.1", "--breakdown"], timeout=120))
    check = next(line for line in out.splitlines() if line.startswith("# check"))
    assert "WRONG" not in check and check.count("OK") == 8, check
    for row in ("ringreduce", "rr-shared-grads", "mpi-loop", "rr-grouped ", "rr-grouped-views",
                "rr-one-array", "mpi-packed"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert out.count("# target:") == 3


def test_torch_step_checks_every_implementation_and_reports_the_targets():
    pytest.importorskip("torch")
    out = stdout(run_mpi(2, BENCH / "torch_step.py",
                         ["--scale", "0.001", "--steps", "2", "--warmup", "0"], timeout=180))
    check = next(line for line in out.splitlines() if line.startswith("# check"))
    assert "WRONG" not in check and check.count(" ok") == 3, check
    for row in ("no-comm", "ringreduce", "rr-no-buckets", "mpi-loop"):
        assert any(line.startswith(row + " ") for line in out.splitlines()), row
    assert out.count("# target:") == 2
    assert "'fallbacks': 0" in out, out


def test_lightning_step_agrees_with_ddp_and_reports_every_implementation():
    pytest.importorskip("lightning")
    out = stdout(run_mpi(2, BENCH / "lightning_step.py",
                         ["--width", "32", "--layers", "2", "--steps", "3", "--warmup", "1"],
                         timeout=180))
    assert "weights after 5 steps: max |diff| 0.00e+00" in out, out  # the same averages
    for row in ("no-comm", "ringreduce", "ddp-gloo"):
        assert any(line.split()[:1] == [row] for line in out.splitlines()), row


def test_allreduce_sweep_with_the_shared_column_finds_no_wrong_result():
    out = stdout(run_mpi(2, BENCH / "allreduce.py",
                         ["--min-bytes", "4", "--max-bytes", "8M", "--factor", "64",
                          "--iters", "2", "--warmup", "1", "--reps", "1", "--peers", "mpi",
                          "--shared", "--out-of-place"], timeout=120))
    assert "# wrong results: none" in out, out
    assert "rr-shared" in out and "rr-oop" in out
    assert out.count("# target: rr-oop") == 1, out  # at 1 MiB (the next size is past 8M)


def test_small_calls_checks_every_call_against_mpi():
    out = stdout(run_mpi(2, BENCH / "small_calls.py",
                         ["--bytes", "4,2K", "--iters", "5", "--warmup", "1", "--reps", "1"],
                         timeout=120))
    assert "# wrong results: none" in out, out
    for row in ("barrier", "allreduce 2048 B", "broadcast_ 4 B", "allgather 4 B",
                "broadcast_object ~2048 B", "allgather_object ~4 B"):
        assert any(line.startswith(row) for line in out.splitlines()), row


def test_jax_step_runs_every_row_and_agrees():
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    out = stdout(run_mpi(2, BENCH / "jax_step.py",
                         ["--width", "64", "--layers", "2", "--steps", "2", "--reps", "1"],
                         timeout=120))
    for row in ("no-comm ", "ringreduce ", "mpi-packed ", "mpi-loop "):
        assert any(line.startswith(row) for line in out.splitlines()), row
    checks = [line for line in out.splitlines() if line.startswith("# check")]
    assert len(checks) == 2 and all(line.endswith("ok") for line in checks), out


def test_ring_series_groups_the_rings():
    out = stdout(run_mpi(2, BENCH / "ring_series.py", ["--mib", "4", "--rings", "6",
                                                       "--period", "3"], timeout=120))
    assert "# median by ring index mod 3: 0:" in out and "# all: median" in out, out
    times = next(line for line in out.splitlines() if not line.startswith("#"))
    assert len(times.split()) == 6


def test_idle_cpu_reports_every_rank():
    out = stdout(run_mpi(2, BENCH / "idle_cpu.py", ["--seconds", "0.2"], timeout=120))
    assert "rank 0" in out and "rank 1" in out, out


def compile_c(source: str, tmp_path) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / source.removesuffix(".c")
    subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
                    str(BENCH / source)], check=True, timeout=60)
    return str(exe)


def run_c(*argv: str) -> str:
    run = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=True)
    assert "WRONG" not in run.stdout and "best" in run.stdout, run.stdout
    return run.stdout


def test_shared_ceiling_compiles_and_sums_right(tmp_path):
    exe = compile_c("shared_ceiling.c", tmp_path)
    for form in ([], ["two-pass"]):
        run_c(exe, "65536", *form)


@pytest.mark.parametrize("stores", ["ordinary", "streaming"])
@pytest.mark.parametrize("floats, chunk", [(65536, 4096), (65537, 4096), (7, 8), (1, 4)])
def test_ring_ceiling_compiles_and_sums_right(tmp_path, floats, chunk, stores):
    """Odd sizes too: the last chunk of a share is partial, a share may be one element; a
    chunk of 8 or 4 bytes puts the streaming stores' slots off 16-byte alignment."""
    form = ["stream"] if stores == "streaming" else []
    out = run_c(compile_c("ring_ceiling.c", tmp_path), str(floats), str(chunk), *form)
    assert f"{floats} floats" in out and f"{stores} stores" in out, out


def test_ps_vs_ring_runs_and_checks_results():
    """Sizes not divisible by 3 (ring chunks of unequal length), and one not a multiple of
    the socket buffers; the exact check covers all three implementations."""
    out = stdout(run_mpi(3, BENCH / "ps_vs_ring.py",
                         ["--min-bytes", "4", "--max-bytes", "4M", "--factor", "32",
                          "--iters", "2", "--warmup", "1", "--reps", "1"], timeout=120))
    assert "# wrong results: none" in out, out
    assert "# traffic per iteration:" in out and "# ps/ring time ratio at N=3" in out, out
    for name in ("ps-tcp", "ring-tcp", "ringreduce"):
        assert name in out, name
    paced = stdout(run_mpi(3, BENCH / "ps_vs_ring.py",
                           ["--min-bytes", "4K", "--max-bytes", "256K", "--factor", "8",
                            "--iters", "2", "--warmup", "1", "--reps", "1",
                            "--link-gbps", "1"], timeout=120))
    assert "# wrong results: none" in paced and "# emulated links:" in paced, paced


def test_keras_scaling_runs_both_libraries_and_the_floor_at_np2():
    """The driver launches its own workers (env-var launch and TF_CONFIG); run_single keeps
    launcher variables out of its environment and kills the whole process tree at the end."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    # np=2 only: the np=1 launches (three more TensorFlow processes) run the same code
    # with one rank, and the target lines need them, so there are none here.
    out = stdout(run_single(BENCH / "keras_scaling.py",
                            ["--steps", "2", "--warmup", "1", "--repeats", "1", "--model",
                             "small", "--nps", "2", "--timeout", "150"], timeout=240))
    lines = out.splitlines()
    for row in ("| ringreduce | 2 |", "| MWMS | 2 |", "| no communication (floor) | 2 |"):
        assert any(line.startswith(row) for line in lines), (row, out)
    assert "efficiency vs own np=2" in out and "# target:" not in out, out
    assert "# check: trainable weights equal across ranks after training: OK" in out, out
    assert "intra-op 1, inter-op 1" in out, out


@pytest.mark.parametrize("program", ["gpu_allreduce", "gpu_step"])
def test_gpu_benchmarks_say_what_is_missing_without_a_gpu(program):
    import ringreduce as rr

    if rr.gpu_info()["cuda_device_count"] and rr.nccl_built():
        pytest.skip("this machine has a GPU: tests/gpu/device_check.sh runs the benchmarks")
    job = run_single(BENCH / f"{program}.py", timeout=60)
    (proc,) = job.procs
    assert proc.returncode == 2, job.describe()
    assert f"{program}: needs one CUDA GPU per rank and NCCL; " in proc.stderr, proc.stderr
    assert rr.gpu_info()["cuda_error"] or "no CUDA device" in proc.stderr


def test_hosts_benchmark_across_network_namespaces():
    """benchmarks/hosts.py at toy sizes: 2 namespace hosts on a shaped link (ringreduce and
    MPICH), and the 2 x 2 hierarchical comparisons (allreduce, allgather); skipped where
    namespaces cannot be made."""
    res = subprocess.run([sys.executable, str(BENCH / "hosts.py"), "--rates", "1gbit",
                          "--hosts", "2", "--sizes", "1M", "--iters", "1", "--seconds", "0"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    if res.stdout.startswith("# skipped:"):
        pytest.skip(res.stdout.strip())
    rows = [line for line in res.stdout.splitlines() if not line.startswith(("#", "config"))]
    assert rows and all(line.endswith("OK") for line in rows), res.stdout
    for label in ("1gbit 2x1 ", "1gbit 2x1 mpich", "2x2 by-host flat", "2x2 by-host hier",
                  "2x2 interleaved hier", "2x2 allgather flat", "2x2 allgather hier"):
        assert any(line.startswith(label) or label in line for line in rows), label
    assert "hierarchical is" in res.stdout


def test_elastic_benchmark_recovers_both_systems():
    pytest.importorskip("torch")
    out = stdout(run_single(BENCH / "elastic.py",
                            ["--mb", "1", "--steps", "30", "--every", "5", "--die-at", "12",
                             "--repeats", "1"], timeout=120))
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("ringreduce", "torchrun")}
    assert rows["ringreduce"][-1] == "2" and rows["torchrun"][-1] == "3", out


def test_autotune_benchmark_tunes_and_reports_every_row():
    out = stdout(run_single(BENCH / "autotune.py",
                            ["--repeats", "1", "--scale", "0.01", "--steps", "3",
                             "--touch-us", "0", "--autotune-steps", "2",
                             "--autotune-trials", "3"], timeout=120))
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| config")}
    assert sorted(rows) == ["autotune", "defaults", "mpi"], out
    # warmup 3 + 3 trials (+ 4 if the model's favourite dueled the start) of 5 x 2 steps
    assert int(rows["autotune"][6]) in ((3 + 3) * 10, (3 + 3 + 4) * 10), out
    assert rows["defaults"][6].strip() == "0" and "auto" in rows["defaults"][8], out
