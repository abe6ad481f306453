"""The GPU tier: real GPUs, real NCCL. Skipped, with one reason, where this process sees no
CUDA device (this machine and CI). On a machine with GPUs it runs the same end-to-end checks
as tests/test_gpu_arrays.py runs on emulated GPUs (tests/workers/gpu_worker.py), on CuPy
arrays and on torch CUDA tensors, one process per GPU (np = the visible GPUs, at most 2),
and a dead-rank test: a rank killed during GPU collectives must not hang the other.

The worker covers allreduce (every dtype and op, fused, grouped), broadcast, reducescatter,
allgather (equal and ragged rows), alltoall (with and without splits), compression='fp16' /
'bf16' through the executor's casting kernels (bits against a numpy reference), a joined
rank (neutral elements for every op, allgather with 0 rows, alltoall refused), and with
torch float16 / bfloat16 tensors and Compression.fp16 / .bf16 (the executor's casts).
With 3 GPUs: the hierarchical allreduce on fake hosts of 2 and 1 ranks, and in a process set.
Also ringreduce.torch's recipe on a CUDA model against one process on the whole batch.

On a machine with fewer GPUs than a test's ranks (one lent GPU), the ranks share the GPUs
(rank r on GPU r mod count). NCCL refuses two ranks of one communicator on one GPU of one
host, so each rank then claims a host of its own (``NCCL_HOSTID``) and NCCL carries every
byte over its socket transport on the loopback: the results are real NCCL results on a real
GPU, the speed is not a GPU's. ``RINGREDUCE_GPU_TEST_SHARE=0`` skips such tests instead."""

from __future__ import annotations

import importlib.util
import os

import pytest
from procs import ROOT, WORKERS, run_env_launch

import ringreduce as rr

_info = rr.gpu_info()
pytestmark = pytest.mark.skipif(
    _info["cuda_device_count"] == 0 or not _info["nccl_version"],
    reason="needs a CUDA device and NCCL: "
    + (_info["cuda_error"] or _info["nccl_error"] or "none"))

WORKER = WORKERS / "gpu_worker.py"


SHARE = os.environ.get("RINGREDUCE_GPU_TEST_SHARE", "1") != "0"


def ranks(want: int = 2) -> int:
    """The ranks a test runs: ``want``, or the GPUs there are when they may not be shared."""
    return want if SHARE else min(want, _info["cuda_device_count"])


def launch(n: int, script, args=(), env=None, rank_env=None, timeout: float = 150):
    """run_env_launch, with each rank on a host of its own for NCCL when ranks share a GPU."""
    rank_env = [dict(e) for e in (rank_env or [{} for _ in range(n)])]
    env = dict(env or {})
    if n > _info["cuda_device_count"]:
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        for r, e in enumerate(rank_env):
            e["NCCL_HOSTID"] = f"rr-gpu-test-{r}"
    return run_env_launch(n, script, args, env=env, rank_env=rank_env, timeout=timeout)


@pytest.mark.parametrize("arrays", ["cupy", "torch"])
def test_collectives_on_real_gpus(arrays):
    module = "cupy" if arrays == "cupy" else "torch"
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    n = ranks()
    job = launch(n, WORKER, ["--arrays", arrays])
    job.check_ok(expect_ranks=n)


def test_torch_cuda_model_equals_one_process_on_the_whole_batch():
    # np=2 == np=1 on CUDA: DistributedOptimizer, broadcasts and SyncBatchNorm unchanged.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    n = ranks()
    job = launch(n, WORKERS / "gpu_torch_worker.py")
    job.check_ok(expect_ranks=n)


def test_dead_rank_during_gpu_collectives_does_not_hang(tmp_path):
    if ranks() < 2 or importlib.util.find_spec("cupy") is None:
        pytest.skip("needs 2 GPUs (or RINGREDUCE_GPU_TEST_SHARE=1) and CuPy")
    script = tmp_path / "dead_rank.py"
    script.write_text(
        "import os, sys, time\n"
        "import cupy\n"
        "import ringreduce as rr\n"
        "rr.init()\n"
        "cupy.cuda.Device(rr.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()\n"
        "x = cupy.ones(1 << 20, cupy.float32)\n"
        "rr.allreduce_(x, name='warm')\n"
        "if rr.rank() == 1:\n"
        "    os._exit(3)\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    for i in range(100):\n"
        "        rr.allreduce_(x, name=f'after.{i}')\n"
        "except rr.RingReduceError as e:\n"
        "    print('FAILED CLEANLY', type(e).__name__, round(time.monotonic() - t, 1))\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n")
    job = launch(2, script, timeout=120)
    assert not job.timed_out, job.describe()
    assert "FAILED CLEANLY" in job.describe(), job.describe()


def test_hierarchical_allreduce_on_real_gpus_and_fake_hosts(tmp_path):
    # One rank per fake host (RINGREDUCE_HOST_ID): NCCL inside each "host", the CPU ring
    # across them; each rank on its own GPU (local_rank is 0 on every fake host).
    if ranks() < 2 or importlib.util.find_spec("cupy") is None:
        pytest.skip("needs 2 GPUs (or RINGREDUCE_GPU_TEST_SHARE=1) and CuPy")
    script = tmp_path / "hierarchical.py"
    script.write_text(
        "import cupy, numpy as np\n"
        "import ringreduce as rr\n"
        "rr.init()\n"
        "cupy.cuda.Device(rr.rank() % cupy.cuda.runtime.getDeviceCount()).use()\n"
        "for n in (1, 1001, 1 << 20):\n"
        "    x = cupy.arange(n, dtype=cupy.float32) % 7 + rr.rank()\n"
        "    rr.allreduce_(x, op=rr.Average, name=f'h.{n}')\n"
        "    want = np.mean([np.arange(n, dtype=np.float32) % 7 + r\n"
        "                    for r in range(rr.size())], axis=0)\n"
        "    np.testing.assert_allclose(x.get(), want, rtol=1e-6)\n"
        "assert rr._comm()._engine.stats()['hierarchical_allreduces'] == 3\n"
        "print('HIERARCHICAL OK')\n")
    job = launch(2, script, env={"RINGREDUCE_HIERARCHICAL_ALLREDUCE": "1"},
                         rank_env=[{"RINGREDUCE_HOST_ID": f"fake-host-{r}"} for r in range(2)],
                         timeout=120)
    job.check_ok()
    assert job.describe().count("HIERARCHICAL OK") == 2, job.describe()


def test_hierarchical_allreduce_on_uneven_fake_hosts_and_a_process_set(tmp_path):
    # 3 GPUs: ranks 0, 1 on one fake host, rank 2 on another (hosts of 2 and 1 ranks: the
    # lcm layout, rank 2 in two cross-host rings); then the set {0, 2} (one rank per host),
    # compressed to float16. Each rank on its own GPU.
    if ranks(3) < 3 or importlib.util.find_spec("cupy") is None:
        pytest.skip("needs 3 GPUs (or RINGREDUCE_GPU_TEST_SHARE=1) and CuPy")
    script = tmp_path / "uneven.py"
    script.write_text(
        "import cupy, numpy as np\n"
        "import ringreduce as rr\n"
        "pair = rr.ProcessSet([0, 2])\n"
        "rr.init(process_sets=[pair])\n"
        "cupy.cuda.Device(rr.rank() % cupy.cuda.runtime.getDeviceCount()).use()\n"
        "for n in (1, 1001, 1 << 20):\n"
        "    x = cupy.arange(n, dtype=cupy.float32) % 7 + rr.rank()\n"
        "    rr.allreduce_(x, op=rr.Sum, name=f'u.{n}')\n"
        "    want = sum(np.arange(n, dtype=np.float32) % 7 + r for r in range(3))\n"
        "    np.testing.assert_array_equal(x.get(), want)\n"
        "if pair.included():\n"
        "    y = cupy.arange(4096, dtype=cupy.float32) % 7 + rr.rank() + 2.0 ** -12\n"
        "    rr.allreduce_(y, op=rr.Sum, name='u.set', process_set=pair, compression='fp16')\n"
        "    np.testing.assert_array_equal(\n"
        "        y.get(), sum(np.arange(4096, dtype=np.float32) % 7 + r for r in (0, 2)))\n"
        "rr.barrier()  # rank 1 must not shut down while the set still runs\n"
        "ran = rr._comm()._engine.stats()['hierarchical_allreduces']\n"
        "assert ran == (4 if pair.included() else 3), ran\n"
        "print('UNEVEN OK')\n")
    job = launch(3, script, env={"RINGREDUCE_HIERARCHICAL_ALLREDUCE": "1"},
                         rank_env=[{"RINGREDUCE_HOST_ID": f"fake-host-{r // 2}"}
                                   for r in range(3)],
                         timeout=180)
    job.check_ok()
    assert job.describe().count("UNEVEN OK") == 3, job.describe()


def test_pytorch_example_trains_on_gpus_and_resumes(tmp_path):
    # The README's training example, unchanged, on CUDA (--device auto picks the GPU): 3
    # epochs, then a resume from rank 0's checkpoint to epoch 5.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    example = ROOT / "examples" / "pytorch_train.py"
    args = ["--checkpoint-dir", tmp_path]
    first = launch(ranks(), example, ["--epochs", 3, *args])
    first.check_ok()
    assert "trains on cuda" in first.describe() and (tmp_path / "ckpt.pt").exists()
    second = launch(ranks(), example, ["--epochs", 5, "--resume", *args])
    second.check_ok()
    accuracy = float(second.describe().split("final test accuracy:")[1].split()[0])
    assert accuracy >= 0.9, second.describe()


def test_gpu_completion_wakes_the_engine_and_leaves_it_asleep_after():
    # The completion wake-up (a watcher thread in cudaEventSynchronize) on a real device:
    # handles resolve as the device finishes, and a late wake-up does not spin the thread.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    job = launch(1, WORKERS / "gpu_wakeup_worker.py", timeout=120)
    job.check_ok(expect_ranks=1)
