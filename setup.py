"""Builds ringreduce._core from csrc/ (C++17, pybind11). No CUDA, MPI or torch needed."""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the sources in parallel (NPY_NUM_BUILD_JOBS, default: every core).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

HERE = os.path.dirname(os.path.abspath(__file__))


def core_sources() -> list:
    """Every .cc under csrc/ except the CUDA-only folder (built separately when nvcc exists)."""
    found = glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True)
    return sorted(s for s in found if os.sep + "gpu" + os.sep not in s or s.endswith("_stub.cc"))


ext = Pybind11Extension(
    "ringreduce._core",
    core_sources(),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-ffp-contract=off", "-fvisibility=hidden"],
    extra_link_args=["-lpthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
