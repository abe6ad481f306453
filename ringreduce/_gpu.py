"""What this build and this machine offer for GPU arrays: the CUDA build, the driver, the
devices and NCCL.

``cuda_built()`` is a property of the build (``setup.py`` compiled ``csrc/gpu/*.cu`` with
nvcc and linked the CUDA runtime statically). NCCL is not linked: ``libnccl.so.2`` is
opened at run time, first from the ``nvidia-nccl-cu12`` wheel (``nvidia/nccl/lib``), then
``$NCCL_HOME/lib``, then the dynamic loader's own search. It is opened once per process,
on the first query, and kept open.

None of these functions raises; ``gpu_info()`` says in words what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any, Optional

from . import _core

_gpu = _core.gpu


def cuda_built() -> bool:
    """True when this build has the CUDA kernels (nvcc was used when it was built)."""
    return bool(_gpu.cuda_built())


def nccl_search_dirs() -> list:
    """Directories searched for ``libnccl.so.2`` before ``$NCCL_HOME/lib`` and the system:
    the ``nvidia-nccl-cu12`` wheel's ``nvidia/nccl/lib`` when it is installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    locations = list(spec.submodule_search_locations or [])
    return [os.path.join(p, "lib") for p in locations if os.path.isdir(os.path.join(p, "lib"))]


class _Nccl:
    """The process's NCCL load attempt: made once, its library or its error kept."""

    lock = threading.Lock()
    done = False
    library: Optional[Any] = None  # _core.gpu.NcclLibrary
    error = ""


def _load_nccl() -> tuple:
    with _Nccl.lock:
        if not _Nccl.done:
            try:
                _Nccl.library = _gpu.load_nccl(nccl_search_dirs())
            except Exception as e:  # a query: report, never raise
                _Nccl.error = str(e)
            _Nccl.done = True
        return _Nccl.library, _Nccl.error


def nccl_library() -> Any:
    """The loaded NCCL (``path``, ``version``); raises RingReduceError saying what was
    searched when it cannot be loaded."""
    from .exceptions import RingReduceError

    library, error = _load_nccl()
    if library is None:
        raise RingReduceError(error)
    return library


def nccl_built() -> bool:
    """True when ``libnccl.so.2`` can be loaded in this process (the first call loads it)."""
    return _load_nccl()[0] is not None


def nccl_version() -> Optional[int]:
    """NCCL's version code (``ncclGetVersion``, e.g. 22703 for 2.27.3), or None without NCCL."""
    library = _load_nccl()[0]
    return None if library is None else int(library.version)


def gpu_info() -> dict:
    """Everything the GPU path depends on, for bug reports and for error messages.

    Keys: ``cuda_built``; ``cuda_runtime_version`` (e.g. 13000, None when not built);
    ``cuda_driver_version`` (the CUDA version the driver supports, 0 without a driver);
    ``cuda_device_count``; ``cuda_error`` (why CUDA is unusable, "" when it is usable);
    ``nccl_version``, ``nccl_version_string``, ``nccl_path`` (None without NCCL) and
    ``nccl_error`` ("" when NCCL loaded). Asking for the device count initializes the
    CUDA driver, as ``torch.cuda.device_count()`` does.
    """
    built = cuda_built()
    library, nccl_error = _load_nccl()
    return {
        "cuda_built": built,
        "cuda_runtime_version": int(_gpu.cuda_runtime_version()) if built else None,
        "cuda_driver_version": int(_gpu.cuda_driver_version()),
        "cuda_device_count": int(_gpu.cuda_device_count()),
        "cuda_error": str(_gpu.cuda_unusable_reason()),
        "nccl_version": None if library is None else int(library.version),
        "nccl_version_string": None if library is None
        else _gpu.nccl_version_string(library.version),
        "nccl_path": None if library is None else str(library.path),
        "nccl_error": nccl_error,
    }


def cuda_device_count() -> int:
    """Visible CUDA devices; 0 without a CUDA build, a driver or a device."""
    return int(_gpu.cuda_device_count())


#: DLPack device types of GPU memory a host pointer cannot read: CUDA, CUDA managed, ROCm.
GPU_DLPACK_DEVICES = {2: "CUDA", 13: "CUDA managed", 10: "ROCm"}


def gpu_status() -> str:
    """One line: what this build and machine have for GPU arrays (for error messages)."""
    info = gpu_info()
    if info["cuda_built"]:
        rt = info["cuda_runtime_version"]
        build = f"built with CUDA {rt // 1000}.{rt % 1000 // 10}"
    else:
        build = "built without CUDA (no nvcc at build time)"
    driver = info["cuda_error"] or f"{info['cuda_device_count']} CUDA device(s)"
    nccl = f"NCCL {info['nccl_version_string']} at {info['nccl_path']}" \
        if info["nccl_version"] else f"no NCCL ({info['nccl_error']})"
    return f"this ringreduce is {build}; {driver}; {nccl}"


def gpu_array_error(what: str, where: str) -> Exception:
    """The InvalidInputError for an array in GPU memory given to a collective that does
    not run on GPU yet, saying what does and what this build and machine have."""
    from .exceptions import InvalidInputError

    return InvalidInputError(
        f"{what}: the array is in {where} memory; on GPU, ringreduce runs allreduce, "
        "grouped_allreduce, allgather, broadcast, reducescatter and alltoall (not Adasum or "
        f"the object calls) so far ({gpu_status()}); copy it to host memory "
        "first (CuPy: x.get(), torch: t.cpu(), TensorFlow: inside tf.device('/CPU:0'))")


#: Testing aid (read when a Communicator starts): "1" makes this process's GPUs emulated
#: ones (csrc/gpu/emulated_gpu_ops.h): host memory, the kernels' CPU reference, and the
#: CPU collectives standing in for NCCL. Never for real work.
EMULATE_ENV = "RINGREDUCE_GPU_EMULATE"


def configure_engine(engine: Any) -> None:
    """Give ``engine`` emulated GPUs when ``RINGREDUCE_GPU_EMULATE=1``."""
    value = os.environ.get(EMULATE_ENV, "0")
    if value not in ("0", "1", ""):
        from .exceptions import InvalidInputError

        raise InvalidInputError(f"{EMULATE_ENV} must be 0 or 1, got {value!r}")
    if value == "1":
        _gpu.use_emulated_gpus(engine)
