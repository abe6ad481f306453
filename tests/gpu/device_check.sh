#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (the `device` tool; its image has
# python3 with torch, CuPy, pytest-xdist, nvcc, pybind11 and the NCCL wheel, and no network):
#
#     bash tests/gpu/device_check.sh            # in the repository root; ~4-6 minutes
#
# Builds the extension in place with nvcc (no pip: nothing can be fetched there), prints
# what the build and the machine have, runs the GPU build tests and the GPU tier (tests/gpu,
# its tests side by side; on fewer GPUs than a test's ranks the ranks share them, see
# test_gpu_real.py), then the GPU benchmark at np=1 and at np=2 (on one GPU the two ranks
# share it: a run that checks, not a measurement), and the ResNet-50 training step
# (benchmarks/gpu_step.py; also with RINGREDUCE_GPU_QUEUE_DEPTH=2 and with
# CUDA_DEVICE_MAX_CONNECTIONS=1). RR_SKIP_TESTS=1 / RR_SKIP_BENCH=1 leave out the tests and
# the sanitizer / the benchmarks. Everything it prints also goes to
# $OUT/gpu_check.log (the device tool brings $OUT back), or to /tmp/rr-gpu-check/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-/tmp/rr-gpu-check}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
PY=${PYTHON:-python3}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "== machine"; nvidia-smi -L; nvcc --version | tail -1; "$PY" --version; nproc
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
stamp "== build"
RINGREDUCE_WITH_CUDA=1 "$PY" setup.py -q build_ext --inplace >"$OUT_DIR/build.log" 2>&1 \
    || { tail -40 "$OUT_DIR/build.log"; echo "BUILD FAILED"; exit 1; }
grep -i "nvcc:\|warning" "$OUT_DIR/build.log" | head -20
"$PY" -c "import ringreduce as rr; print(rr.gpu_info())"
tests=0
if [ "${RR_SKIP_TESTS:-0}" = 0 ]; then
stamp "== tests"
xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 6")
timeout 330 "$PY" -m pytest -q -rs -p no:cacheprovider $xdist --durations=12 \
    tests/test_gpu_build.py tests/gpu
tests=$?
stamp "== compute-sanitizer memcheck: the kernel self-test, then the worker at np=2"
# NCCL probes for kernel images it lacks (cudaFuncGetAttributes, error 209): API errors
# are not ours to report; memory errors in any kernel are.
san="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 20"
timeout 120 $san "$PY" -c "from ringreduce import _core; print('selftest:', repr(_core.gpu.kernel_selftest(0)))"
echo "sanitizer (selftest) exit $?"
gpus=$(nvidia-smi -L | wc -l)
pids=()
for r in 0 1; do
  share=(); [ "$gpus" -lt 2 ] && share=(NCCL_HOSTID="rr-sanitizer-$r" NCCL_SOCKET_IFNAME=lo)
  env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
      "${share[@]}" timeout 200 $san \
      "$PY" tests/workers/gpu_worker.py --arrays cupy >"$OUT_DIR/sanitizer_rank$r.log" 2>&1 &
  pids+=($!)
done
fails=0
for pid in "${pids[@]}"; do wait "$pid" || fails=$((fails + 1)); done
tail -n 3 "$OUT_DIR/sanitizer_rank0.log" "$OUT_DIR/sanitizer_rank1.log"
echo "sanitizer (worker, np=2): $fails rank(s) failed"
fi
stamp "== benchmark"
if [ "${RR_SKIP_BENCH:-0}" = 0 ]; then
  for n in 1 2; do
    timeout 100 "$PY" -m ringreduce -np $n "$PY" benchmarks/gpu_allreduce.py \
        --min-bytes 8 --factor 8 --max-bytes $(( n == 1 ? 128 << 20 : 16 << 20 )) --reps 3
    timeout 60 "$PY" -m ringreduce -np $n "$PY" benchmarks/gpu_allreduce.py \
        --op allgather --max-bytes $(( n == 1 ? 64 << 20 : 4 << 20 )) --reps 3
  done
  timeout 150 "$PY" -m ringreduce -np 1 "$PY" benchmarks/gpu_step.py --steps 20
  # The same with a batching window as long as a backward pass: fewer, larger responses.
  RINGREDUCE_BATCH_US=1000 RINGREDUCE_BATCH_MAX_US=20000 timeout 150 \
      "$PY" -m ringreduce -np 1 "$PY" benchmarks/gpu_step.py --steps 20
  timeout 100 "$PY" -m ringreduce -np 2 "$PY" benchmarks/gpu_step.py --model small --steps 5
  # The opt-in backlog hold, against the line above (fewer, larger NCCL calls where each is slow).
  RINGREDUCE_GPU_QUEUE_DEPTH=2 timeout 100 \
      "$PY" -m ringreduce -np 2 "$PY" benchmarks/gpu_step.py --model small --steps 5
  # Streams sharing one hardware queue (Megatron's setting): nothing of ours may stall compute.
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 150 \
      "$PY" -m ringreduce -np 1 "$PY" benchmarks/gpu_step.py --steps 20
fi
stamp "== done: tests exit $tests"
exit $tests
