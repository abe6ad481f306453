#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (the `device` tool; its image has
# python3 with torch, CuPy, nvcc, pybind11 and the NCCL wheel, and no network):
#
#     bash tests/gpu/device_check.sh            # in the repository root; ~5-8 minutes
#
# Builds the extension in place with nvcc (no pip: nothing can be fetched there), prints
# what the build and the machine have, runs the GPU build tests and the GPU tier
# (tests/gpu: np = the visible GPUs, at most 2; a single GPU runs every check at np=1),
# then the GPU benchmark at np = the visible GPUs (at most 2). Everything it prints also
# goes to $OUT/gpu_check.log (the device tool brings $OUT back), or to
# /tmp/rr-gpu-check/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-/tmp/rr-gpu-check}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== machine"; date; nvidia-smi -L; nvcc --version | tail -1; "$PY" --version
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
echo "== build"
start=$(date +%s)
RINGREDUCE_WITH_CUDA=1 "$PY" setup.py -q build_ext --inplace || { echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
"$PY" -c "import ringreduce as rr; print(rr.gpu_info())"
echo "== tests"
timeout 420 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_build.py tests/gpu
tests=$?
echo "== benchmark"
n=$("$PY" -c "import ringreduce as rr; print(min(2, rr.gpu_info()['cuda_device_count']))")
if [ "$n" -ge 1 ]; then
  timeout 180 "$PY" -m ringreduce -np "$n" "$PY" benchmarks/gpu_allreduce.py \
      --max-bytes $((256 << 20)) --reps 3
  timeout 120 "$PY" -m ringreduce -np "$n" "$PY" benchmarks/gpu_allreduce.py \
      --op allgather --max-bytes $((64 << 20)) --reps 3
else
  echo "no CUDA device: no benchmark"
fi
echo "== done: tests exit $tests"
exit $tests
