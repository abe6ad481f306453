"""Builds ringreduce._core from csrc/ (C++17, pybind11). No MPI or torch needed.

CUDA is optional. RINGREDUCE_WITH_CUDA=auto (the default) compiles csrc/gpu/*.cu with
nvcc when nvcc is found (on PATH, or in $CUDA_HOME/bin) and links the CUDA runtime
statically, so the installed extension needs no CUDA toolkit, only an NVIDIA driver that
supports the runtime (CUDA 13: driver 580 or newer). Without nvcc it builds CPU-only.
RINGREDUCE_WITH_CUDA=0 builds CPU-only even with nvcc; =1 fails when nvcc is missing.
NCCL is never linked: libnccl.so.2 is opened at run time (csrc/gpu/nccl_loader.cc).
"""

import glob
import os
import shutil
import subprocess
import sys
import time

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the sources in parallel (NPY_NUM_BUILD_JOBS, default: every core).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

HERE = os.path.dirname(os.path.abspath(__file__))

# SASS for Ampere (sm_80; also runs on sm_86/sm_89) and Hopper (sm_90), and compute_90 PTX
# that the driver compiles for newer GPUs (Blackwell) on first use.
CUDA_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
]


def core_sources() -> list:
    """Every .cc under csrc/ (csrc/gpu/*.cc are plain C++); .cu files go to nvcc."""
    return sorted(glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True))


def cuda_sources() -> list:
    return sorted(glob.glob(os.path.join(HERE, "csrc", "gpu", "*.cu")))


def _find_nvcc() -> "str | None":
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_home(nvcc: str) -> str:
    """The toolkit nvcc belongs to (nvcc may be a wrapper script, so ask it)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isdir(home):
            return home
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:  # "#$ TOP=/usr/local/cuda-13.0/bin/.."
                return os.path.normpath(line.split("TOP=", 1)[1].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _static_cudart(home: str) -> "str | None":
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        path = os.path.join(home, sub, "libcudart_static.a")
        if os.path.exists(path):
            return path
    return None


def cuda_config() -> "dict | None":
    """nvcc and the static CUDA runtime to build with, or None for a CPU-only build."""
    mode = os.environ.get("RINGREDUCE_WITH_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        sys.exit(f"RINGREDUCE_WITH_CUDA={mode!r}: use auto (default), 0 or 1")
    if mode == "0":
        return None
    nvcc = _find_nvcc()
    if nvcc is None:
        if mode == "1":
            sys.exit("RINGREDUCE_WITH_CUDA=1 but nvcc was not found on PATH or in "
                     "$CUDA_HOME/bin; install the CUDA toolkit (nvcc) or unset the variable "
                     "for a CPU-only build")
        return None
    home = _cuda_home(nvcc)
    cudart = _static_cudart(home)
    if cudart is None:
        sys.exit(f"nvcc found at {nvcc}, but no libcudart_static.a under {home}; set CUDA_HOME "
                 "to the toolkit, or RINGREDUCE_WITH_CUDA=0 for a CPU-only build")
    return {"nvcc": nvcc, "home": home, "cudart": cudart}


CUDA = cuda_config()
HAVE = "1" if CUDA else "0"


class BuildExt(build_ext):
    """pybind11's build_ext, with csrc/gpu/*.cu compiled by nvcc first (when CUDA is on)
    and linked into the extension together with the static CUDA runtime."""

    def build_extensions(self) -> None:
        # A stamp that changes with the mode, so an in-place rebuild after switching
        # RINGREDUCE_WITH_CUDA relinks (and recompiles) instead of keeping the old .so.
        os.makedirs(self.build_temp, exist_ok=True)
        stamp = os.path.join(self.build_temp, "cuda_mode.txt")
        mode = f"RR_HAVE_CUDA={HAVE} {CUDA_GENCODE if CUDA else ''}"
        old = None
        if os.path.exists(stamp):
            with open(stamp) as f:
                old = f.read()
        if old != mode:
            with open(stamp, "w") as f:
                f.write(mode)
        for ext in self.extensions:
            ext.depends = ext.depends + [stamp]
        if CUDA:
            objects = self._compile_cuda()
            for ext in self.extensions:
                ext.depends = ext.depends + objects  # a changed .cu relinks the extension
                ext.extra_objects = objects + [CUDA["cudart"]] + ext.extra_objects
                # Keep cudart's symbols private to _core: a libcudart loaded by torch or
                # CuPy in the same process must not bind to ours, nor ours to theirs.
                ext.extra_link_args = ext.extra_link_args + ["-Wl,--exclude-libs,ALL",
                                                             "-ldl", "-lrt"]
        super().build_extensions()

    def _compile_cuda(self) -> list:
        out_dir = os.path.abspath(os.path.join(self.build_temp, "cuda"))
        os.makedirs(out_dir, exist_ok=True)
        headers = glob.glob(os.path.join(HERE, "csrc", "**", "*.h"), recursive=True)
        newest_header = max((os.path.getmtime(h) for h in headers), default=0.0)
        objects, jobs = [], []
        for src in cuda_sources():
            obj = os.path.join(out_dir, os.path.basename(src)[: -len(".cu")] + ".o")
            objects.append(obj)
            if (os.path.exists(obj) and not self.force
                    and os.path.getmtime(obj) > max(os.path.getmtime(src), newest_header)):
                continue
            cmd = [CUDA["nvcc"], "-std=c++17", "-O3", "--fmad=false",
                   "-I" + os.path.join(HERE, "csrc"), "-DRR_HAVE_CUDA=1", "-DRR_HAVE_NCCL=1",
                   "-Xcompiler", "-fPIC,-Wall,-Wextra,-fvisibility=hidden,-ffp-contract=off",
                   *CUDA_GENCODE, "-c", src, "-o", obj]
            jobs.append((src, cmd))
        start = time.time()
        # One nvcc per file, all at once (each spends most of its time in one process).
        procs = [(src, cmd, subprocess.Popen(cmd, cwd=HERE)) for src, cmd in jobs]
        failed = [(src, cmd) for src, cmd, p in procs if p.wait() != 0]
        if failed:
            sys.exit("nvcc failed on " + ", ".join(src for src, _ in failed) + ":\n  "
                     + " ".join(failed[0][1]))
        if jobs:
            print(f"nvcc: {len(jobs)} CUDA file(s) in {time.time() - start:.1f} s", flush=True)
        return objects


ext = Pybind11Extension(
    "ringreduce._core",
    core_sources(),
    include_dirs=["csrc"],
    cxx_std=17,
    define_macros=[("RR_HAVE_CUDA", HAVE), ("RR_HAVE_NCCL", HAVE)],
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-ffp-contract=off", "-fvisibility=hidden"],
    extra_link_args=["-lpthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
