"""The GPU build and loading layer, tested without a GPU: the CUDA objects are in the
extension when nvcc built it, NCCL loads from the nvidia-nccl-cu12 wheel and reports its
version, a machine without a driver gets a clear reason (no crash), and the kernels'
planning (csrc/gpu/pack_plan.cc) and their element code run on the CPU
(csrc/gpu/kernels_reference.cc) give the right bytes. On a machine with a GPU the kernels
themselves are compared with that CPU reference bit for bit (test_kernels_match_reference).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ringreduce as rr
from ringreduce import _core, _gpu
from ringreduce._dtypes import (
    BFLOAT16,
    BOOL,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    INT8,
    INT32,
    INT64,
    UINT8,
)
from ringreduce.exceptions import InvalidInputError, RingReduceError

ROOT = Path(__file__).resolve().parents[1]
G = _core.gpu
SO = Path(_core.__file__)

pytestmark = pytest.mark.timeout(60)


def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=str(ROOT))


# ---------------------------------------------------------------- the build


def nvcc_expected() -> bool:
    return shutil.which("nvcc") is not None and os.environ.get("RINGREDUCE_WITH_CUDA") != "0"


def elf_sections(path: Path) -> dict:
    """{name: bytes} of an ELF64 little-endian file's sections (no binutils needed)."""
    data = path.read_bytes()
    assert data[:6] == b"\x7fELF\x02\x01", f"{path} is not a 64-bit little-endian ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    strtab = data[names[4]:names[4] + names[5]]
    out = {}
    for name, kind, _, _, offset, size in headers:
        label = strtab[name:strtab.index(b"\0", name)].decode()
        out[label] = b"" if kind == 8 else data[offset:offset + size]  # 8: SHT_NOBITS
    return out


def needed_libraries(sections: dict) -> list:
    """DT_NEEDED entries of the .dynamic section."""
    dynamic, dynstr = sections[".dynamic"], sections[".dynstr"]
    out = []
    for pos in range(0, len(dynamic), 16):
        tag, value = struct.unpack_from("<qQ", dynamic, pos)
        if tag == 1:
            out.append(dynstr[value:dynstr.index(b"\0", value)].decode())
    return out


def fatbin_images(sections: dict) -> set:
    """(kind, sm) of every image in the .nv_fatbin section: kind 'elf' (SASS) or 'ptx'.

    The layout (cuobjdump reads the same): a 16-byte header (magic 0xBA55ED50, version,
    header size, size) then entries of (kind: u16 1=PTX 2=ELF, u16, header size: u32,
    payload size: u64, u32, u32, minor: u16, major: u16, arch: u32, ...).
    """
    assert ".nv_fatbin" in sections, "the extension has no .nv_fatbin section (no CUDA kernels)"
    data = sections[".nv_fatbin"]
    images, pos = set(), 0
    while pos + 16 <= len(data):
        magic, _, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:
            pos += 8  # fatbins are 8-byte aligned in the section
            continue
        entry, end = pos + header, pos + header + body
        while entry + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            images.add(({1: "ptx", 2: "elf"}.get(kind, str(kind)), arch))
            entry += entry_header + payload
        pos = end
    return images


def test_cuda_objects_in_extension():
    if not nvcc_expected():
        pytest.skip("nvcc is not on PATH (or RINGREDUCE_WITH_CUDA=0): this build is CPU-only "
                    "by design; CI builds with nvcc and runs this check")
    assert rr.cuda_built(), (
        "nvcc is on PATH but the extension was built without CUDA; rebuild it "
        "(pip install -e . --no-deps --no-build-isolation)")
    sections = elf_sections(SO)
    images = fatbin_images(sections)
    assert {("elf", 80), ("elf", 90), ("ptx", 90)} <= images, images
    blob = SO.read_bytes()
    for kernel in (b"rr_pack_kernel", b"rr_unpack_kernel", b"rr_scale_kernel", b"rr_cast_kernel"):
        assert kernel in blob, kernel
    # The runtime is linked statically: no CUDA library is needed at run time.
    needed = needed_libraries(sections)
    assert "libc.so.6" in needed, needed
    assert not [n for n in needed if "cuda" in n or "nccl" in n], needed
    assert G.cuda_runtime_version() >= 12000
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:  # the toolkit's own view, where it is installed
        listed = subprocess.run([cuobjdump, "--list-elf", str(SO)], capture_output=True,
                                text=True, timeout=60).stdout
        assert "sm_80" in listed and "sm_90" in listed, listed


def test_cpu_only_build_says_so():
    if rr.cuda_built():
        pytest.skip("this build has CUDA")
    info = rr.gpu_info()
    assert info["cuda_runtime_version"] is None and info["cuda_device_count"] == 0
    assert "built without CUDA" in info["cuda_error"]
    with pytest.raises(RingReduceError, match="built without CUDA"):
        G.kernel_selftest(0)


# pybind11 is a build requirement, installed in pip's isolated build environment and not
# necessarily in the test environment; setup.py only needs these three names to load.
FAKE_PYBIND11 = """
from setuptools import Extension
from setuptools.command.build_ext import build_ext


class ParallelCompile:
    def __init__(self, *args, **kwargs):
        pass

    def install(self):
        return self


class Pybind11Extension(Extension):
    def __init__(self, *args, cxx_std=None, **kwargs):
        super().__init__(*args, **kwargs)
"""


def setup_py(tmp_path: Path, **env_changes) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_changes)
    if importlib.util.find_spec("pybind11") is None:
        (tmp_path / "pybind11").mkdir(exist_ok=True)
        (tmp_path / "pybind11" / "__init__.py").write_text("")
        (tmp_path / "pybind11" / "setup_helpers.py").write_text(FAKE_PYBIND11)
        env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run([sys.executable, "setup.py", "--name"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=str(ROOT))


def test_with_cuda_1_without_nvcc_fails_loudly(tmp_path):
    bare_path = os.path.dirname(sys.executable)  # no nvcc there
    no_cuda = {"PATH": bare_path, "CUDA_HOME": "", "CUDA_PATH": ""}
    out = setup_py(tmp_path, RINGREDUCE_WITH_CUDA="1", **no_cuda)
    assert out.returncode != 0
    assert "RINGREDUCE_WITH_CUDA=1 but nvcc was not found" in out.stderr
    out = setup_py(tmp_path, RINGREDUCE_WITH_CUDA="auto", **no_cuda)
    assert out.returncode == 0 and out.stdout.strip() == "ringreduce", out.stderr
    out = setup_py(tmp_path, RINGREDUCE_WITH_CUDA="yes")
    assert out.returncode != 0 and "use auto (default), 0 or 1" in out.stderr


# ---------------------------------------------------------------- driver and devices


def test_no_driver_gives_a_reason_not_a_crash():
    n = _gpu.cuda_device_count()
    info = rr.gpu_info()
    assert info["cuda_device_count"] == n
    if n > 0:
        assert info["cuda_error"] == ""
        assert info["cuda_driver_version"] >= info["cuda_runtime_version"] // 1000 * 1000
        return
    # This machine (and CI): no GPU. The reason names what is missing.
    assert info["cuda_error"]
    if rr.cuda_built():
        assert info["cuda_runtime_version"] >= 12000
        assert re.search(r"no NVIDIA driver|driver supports CUDA|cudaGetDeviceCount|no CUDA "
                         r"device", info["cuda_error"]), info["cuda_error"]
        assert "580" in info["cuda_error"] or "cudaGetDeviceCount" in info["cuda_error"]
    if info["cuda_driver_version"] == 0:
        assert "no NVIDIA driver" in info["cuda_error"] or not rr.cuda_built()


def test_kernels_match_reference():
    if _gpu.cuda_device_count() == 0:
        pytest.skip("no usable CUDA device: " + rr.gpu_info()["cuda_error"])
    assert G.kernel_selftest(0) == ""


# ---------------------------------------------------------------- NCCL


def wheel_dirs() -> list:
    if importlib.util.find_spec("nvidia.nccl") is None:
        pytest.skip("nvidia-nccl-cu12 is not installed (pip install -e '.[test]' installs it)")
    return _gpu.nccl_search_dirs()


def test_nccl_loads_from_the_wheel_without_a_gpu():
    dirs = wheel_dirs()
    assert dirs and all(Path(d, "libnccl.so.2").exists() for d in dirs)
    assert rr.nccl_built() is True
    lib = _gpu.nccl_library()
    assert Path(lib.path).resolve() == Path(dirs[0], "libnccl.so.2").resolve()
    # The version ncclGetVersion reports is the wheel's (2.x.y -> 2 * 10000 + x * 100 + y).
    # nvidia-nccl-cu12 here and in CI; a CUDA 13 machine may have nvidia-nccl-cu13 instead.
    wheel = next(d for d in importlib.metadata.distributions()
                 if (d.metadata["Name"] or "").lower().startswith("nvidia-nccl-cu"))
    major, minor, patch = (int(p) for p in wheel.version.split(".")[:3])
    assert rr.nccl_version() == major * 10000 + minor * 100 + patch
    assert G.nccl_version_string(rr.nccl_version()) == f"{major}.{minor}.{patch}"
    info = rr.gpu_info()
    assert info["nccl_version"] == rr.nccl_version() and info["nccl_error"] == ""
    # A second load gives another handle on the same library (no process-wide singleton).
    again = G.load_nccl(dirs)
    assert again.version == lib.version and again.path == lib.path
    del again


def test_nccl_version_strings():
    assert G.nccl_version_string(22703) == "2.27.3"
    assert G.nccl_version_string(2804) == "2.8.4"  # the scheme before 2.9


def test_missing_nccl_is_a_clear_error_and_queries_do_not_raise():
    code = """
import ringreduce as rr
from ringreduce import _core, _gpu
try:
    _core.gpu.load_nccl(["/nonexistent-dir"])
    print("LOADED")
except rr.RingReduceError as e:
    print("ERROR", e)
_gpu.nccl_search_dirs = lambda: ["/nonexistent-dir"]
print("QUERIES", rr.nccl_built(), rr.nccl_version(), repr(rr.gpu_info()["nccl_error"][:40]))
"""
    out = run_python(code, NCCL_HOME="/nonexistent-home", LD_LIBRARY_PATH=None)
    assert out.returncode == 0, out.stderr
    if "LOADED" in out.stdout:
        pytest.skip("this machine has a system libnccl.so.2")
    assert "/nonexistent-dir/libnccl.so.2" in out.stdout
    assert "/nonexistent-home/lib/libnccl.so.2" in out.stdout
    assert "pip install nvidia-nccl-cu12" in out.stdout
    assert "QUERIES False None 'NCCL (libnccl.so.2) could not be loaded" in out.stdout


# ---------------------------------------------------------------- the pack plan

FUSION = 1 << 40  # a fake device address, 256-byte aligned


def plan(sizes, addrs=None, capacity=None, **opts):
    sizes = np.asarray(sizes, np.uint64)
    if addrs is None:  # disjoint fake tensors in increasing order, odd alignments too
        addrs = np.uint64(1 << 20) + np.cumsum(sizes + np.uint64(4096 + 3)) - sizes
    entries = np.stack([np.asarray(addrs, np.uint64), sizes], axis=1) if len(sizes) else \
        np.zeros((0, 2), np.uint64)
    cap = capacity if capacity is not None else int(sizes.sum()) + 256 * len(sizes) + 256
    return entries, G.plan_pack(entries, FUSION, cap, **opts)


def check_plan(entries: np.ndarray, p: dict, alignment: int = 256, threads: int = 256,
               max_blocks: int = 1024) -> None:
    addrs, sizes = entries[:, 0], entries[:, 1]
    offsets, descs = p["offsets"], p["descs"]
    assert offsets.dtype == np.uint64 and len(offsets) == len(entries)
    assert np.all(offsets % np.uint64(alignment) == 0)
    if len(entries):
        assert np.all(offsets[1:] >= offsets[:-1] + sizes[:-1])  # in order, no overlap
        assert np.all(offsets[1:] - (offsets[:-1] + sizes[:-1]) < alignment)  # no waste
        assert p["bytes"] == int(offsets[-1] + sizes[-1])
    else:
        assert p["bytes"] == 0
    # Every byte of every tensor is copied exactly once, to its own place.
    nonempty = sizes > 0
    assert descs.shape[1] == 3 and int(descs[:, 2].sum()) == int(sizes.sum())
    assert np.all(descs[:, 2] > 0) and np.all(descs[:, 2] <= p["chunk_bytes"])
    owner = np.searchsorted(addrs, descs[:, 0], side="right") - 1 if len(descs) else \
        np.zeros(0, np.int64)
    if len(descs):
        assert np.all(np.diff(owner) >= 0)
        assert np.all(descs[:, 0] + descs[:, 2] <= addrs[owner] + sizes[owner])
        inner = descs[:, 0] - addrs[owner]
        assert np.array_equal(descs[:, 1], np.uint64(FUSION) + offsets[owner] + inner)
        # Within a tensor the pieces are contiguous: each starts where the last ended.
        first = np.ones(len(descs), bool)
        first[1:] = owner[1:] != owner[:-1]
        assert np.all(inner[first] == 0)
        prev_end = descs[:-1, 0] + descs[:-1, 2]
        assert np.array_equal(descs[1:, 0][~first[1:]], prev_end[~first[1:]])
        assert np.array_equal(np.unique(owner), np.flatnonzero(nonempty))
        assert p["chunk_bytes"] % 16 == 0  # splits keep 16-byte alignment
    # Launch arguments within CUDA's limits and the plan's options.
    if len(descs) == 0:
        assert (p["blocks"], p["threads"]) == (0, 0)
    else:
        assert p["threads"] == threads and p["threads"] % 32 == 0 and p["threads"] <= 1024
        warps = p["threads"] // 32
        assert 1 <= p["blocks"] <= min(max_blocks, 2**31 - 1)
        assert p["blocks"] == min(max_blocks, -(-len(descs) // warps))


def test_plan_mixed_sizes():
    sizes = [1, 0, 7, 256, 4096, 100_000, 3, 1 << 22, 0, 255, 257]
    entries, p = plan(sizes)
    check_plan(entries, p)
    assert list(p["offsets"][:4]) == [0, 256, 256, 512]


@pytest.mark.parametrize("alignment", [1, 16, 64, 256, 4096])
def test_plan_alignments(alignment):
    entries, p = plan([5, 17, 0, 300, 1], alignment=alignment, capacity=1 << 20)
    check_plan(entries, p, alignment=alignment)


def test_plan_zero_size_tensors():
    entries, p = plan([0, 0, 0])
    check_plan(entries, p)
    assert list(p["offsets"]) == [0, 0, 0] and p["bytes"] == 0 and len(p["descs"]) == 0
    assert (p["blocks"], p["threads"]) == (0, 0)  # nothing to launch
    entries, p = plan([])
    check_plan(entries, p)


def test_plan_many_tiny_tensors():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 9, 200_000)
    entries, p = plan(sizes)
    check_plan(entries, p)
    assert len(p["descs"]) == int(np.count_nonzero(sizes))  # one descriptor each
    assert p["blocks"] == 1024  # one launch; warps loop over the descriptors


def test_plan_huge_counts_stay_bounded():
    tb = 1 << 40
    entries, p = plan([tb, 3, tb // 3], capacity=1 << 42)
    check_plan(entries, p)
    warps = 1024 * 256 // 32
    assert len(p["descs"]) <= 3 + 2 * warps  # the chunk grows with the total
    assert p["chunk_bytes"] % 4096 == 0


def test_plan_explicit_chunk_and_launch_options():
    entries, p = plan([100_000, 10, 40_000], chunk_bytes=4096, threads=64, max_blocks=3)
    check_plan(entries, p, threads=64, max_blocks=3)
    assert p["chunk_bytes"] == 4096 and len(p["descs"]) == 25 + 1 + 10
    entries, p = plan([1 << 20], threads=1024, max_blocks=2**31 - 1)
    check_plan(entries, p, threads=1024, max_blocks=2**31 - 1)


def test_plan_rejects_bad_input():
    e = np.array([[4096, 100]], np.uint64)
    with pytest.raises(InvalidInputError, match="it holds 99"):
        G.plan_pack(e, FUSION, 99)
    with pytest.raises(InvalidInputError, match="not aligned"):
        G.plan_pack(e, FUSION + 8, 1000)
    with pytest.raises(InvalidInputError, match="wraps? around"):
        G.plan_pack(np.array([[2**64 - 10, 100]], np.uint64), FUSION, 1000)
    with pytest.raises(InvalidInputError, match="wraps? around"):
        G.plan_pack(e, 2**64 - 256, 1000)
    with pytest.raises(InvalidInputError, match="overflows"):
        G.plan_pack(np.array([[0, 2**63], [0, 2**63]], np.uint64), 0, 2**64 - 1)
    for threads in (0, 33, 2048):
        with pytest.raises(InvalidInputError, match="threads per block"):
            G.plan_pack(e, FUSION, 1000, threads=threads)
    with pytest.raises(InvalidInputError, match="max_blocks"):
        G.plan_pack(e, FUSION, 1000, max_blocks=0)
    with pytest.raises(InvalidInputError, match="power of two"):
        G.plan_pack(e, FUSION, 1000, alignment=48)
    with pytest.raises(InvalidInputError, match="multiple of 16"):
        G.plan_pack(e, FUSION, 1000, chunk_bytes=1000)
    with pytest.raises(InvalidInputError, match=r"shape \(n, 2\)"):
        G.plan_pack(np.zeros((2, 3), np.uint64), FUSION, 1000)


def test_elementwise_launch():
    assert G.elementwise_launch(0) == (0, 0)
    assert G.elementwise_launch(1) == (1, 256)
    assert G.elementwise_launch(257) == (2, 256)
    assert G.elementwise_launch(10**12) == (4096, 256)  # grid-stride covers the rest
    assert G.elementwise_launch(10**6, threads=1024, max_blocks=2**31 - 1) == (977, 1024)
    with pytest.raises(InvalidInputError):
        G.elementwise_launch(10, threads=100)


# ------------------------------------------------- the kernels' code, run on the CPU


def aligned(nbytes: int, align: int = 256) -> np.ndarray:
    raw = np.empty(nbytes + align, np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip:skip + nbytes]


@pytest.mark.parametrize("chunk", [0, 16, 4096])
def test_reference_pack_unpack_round_trip(chunk):
    rng = np.random.default_rng(chunk)
    arena = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    # (offset in the arena, bytes): every alignment class of both ends
    layout = [(0, 100_000), (100_003, 1), (100_016, 0), (100_020, 4099), (200_001, 77_777),
              (300_000, 16), (300_017, 15), (400_000, 262_144), (700_001, 33)]
    entries = np.array([[arena.ctypes.data + o, n] for o, n in layout], np.uint64)
    fusion = aligned(1 << 20)
    fusion[:] = 0xAB
    p = G.plan_pack(entries, fusion.ctypes.data, fusion.nbytes, chunk_bytes=chunk)
    G.reference_copy(p["descs"], True)
    written = np.zeros(fusion.nbytes, bool)
    for (o, n), off in zip(layout, p["offsets"]):
        assert np.array_equal(fusion[off:off + n], arena[o:o + n])
        written[off:off + n] = True
    assert np.all(fusion[~written] == 0xAB)  # gaps and the rest untouched

    out = np.zeros_like(arena)
    out_entries = np.array([[out.ctypes.data + o, n] for o, n in layout], np.uint64)
    q = G.plan_pack(out_entries, fusion.ctypes.data, fusion.nbytes, chunk_bytes=chunk)
    assert np.array_equal(q["offsets"], p["offsets"])
    G.reference_copy(q["descs"], False)
    covered = np.zeros(out.nbytes, bool)
    for o, n in layout:
        covered[o:o + n] = True
    assert np.array_equal(out[covered], arena[covered]) and np.all(out[~covered] == 0)


def cpu_scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """The CPU collectives' scaling (scale_inplace), through a one-rank allreduce."""
    from ringreduce.testing import make_world

    (comm,) = make_world(1)
    try:
        return comm.allreduce(x, rr.Sum, "scale", factor, 1.0)
    finally:
        comm.close()


def special_values(dtype: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        v = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        v[:6] = [info.min, info.max, 0, 1, -1 if dtype.kind == "i" else 2, info.max - 1]
        return v
    # Every bit pattern: NaNs with payloads, infinities, subnormals, both signs.
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).copy()


def test_reference_scale_matches_cpu_collectives():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    for code, dtype in [(UINT8, np.uint8), (INT8, np.int8), (INT32, np.int32),
                        (INT64, np.int64), (FLOAT16, np.float16),
                        (BFLOAT16, ml_dtypes.bfloat16), (FLOAT32, np.float32),
                        (FLOAT64, np.float64)]:
        x = special_values(np.dtype(dtype), 20_000, rng)
        for factor in (0.5, 1 / 3, -7.25, 1e30):
            got = x.copy()
            G.reference_scale(got.view(np.uint8), code, factor)
            want = cpu_scaled(x, factor)
            assert got.tobytes() == want.tobytes(), (np.dtype(dtype).name, factor)
    with pytest.raises(InvalidInputError, match="bool cannot be scaled"):
        G.reference_scale(np.zeros(4, np.bool_), BOOL, 2.0)


def bf16_bits_exact(d: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 rounded once to nearest even, for normal bfloat16 results."""
    b = d.view(np.uint64)
    mag = b & np.uint64(0x7FFF_FFFF_FFFF_FFFF)
    r = (mag + np.uint64((1 << 44) - 1) + ((mag >> np.uint64(45)) & np.uint64(1))) >> \
        np.uint64(45)
    exp = (r >> np.uint64(7)) - np.uint64(1023 - 127)
    bits = ((b >> np.uint64(48)) & np.uint64(0x8000)) | (exp << np.uint64(7)) | \
        (r & np.uint64(0x7F))
    return bits.astype(np.uint16)


def test_reference_casts():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(2)

    def cast(x, frm, to, dtype):
        out = np.empty(x.shape, dtype)
        G.reference_cast(x.view(np.uint8), frm, out.view(np.uint8), to)  # bytes: bf16 too
        return out

    def same(a, b):  # bitwise, except that any NaN equals any NaN
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        nan = np.isnan(a32)
        assert np.array_equal(nan, np.isnan(b32))
        assert a[~nan].tobytes() == b[~nan].tobytes()

    f32 = special_values(np.dtype(np.float32), 50_000, rng)
    f64 = special_values(np.dtype(np.float64), 50_000, rng)
    f64 = np.concatenate([f64, rng.standard_normal(50_000) * 10.0 ** rng.integers(-8, 6, 50_000)])
    h = special_values(np.dtype(np.float16), 65536, rng)
    b = special_values(np.dtype(np.uint16), 65536, rng).view(bf16)
    with np.errstate(all="ignore"):  # numpy warns about the NaNs it converts
        same(cast(f32, FLOAT32, FLOAT16, np.float16), f32.astype(np.float16))
        same(cast(f64, FLOAT64, FLOAT16, np.float16), f64.astype(np.float16))  # one rounding
        same(cast(f32, FLOAT32, BFLOAT16, bf16), f32.astype(bf16))
        same(cast(h, FLOAT16, FLOAT32, np.float32), h.astype(np.float32))
        same(cast(h, FLOAT16, FLOAT64, np.float64), h.astype(np.float64))
        same(cast(b, BFLOAT16, FLOAT32, np.float32), b.astype(np.float32))
        same(cast(b, BFLOAT16, FLOAT64, np.float64), b.astype(np.float64))
    # float64 -> bfloat16 rounds once: 1 + 2^-8 + 2^-40 is above the halfway point
    # (going through float32 would make it a tie and round down to 1).
    d = np.array([1 + 2**-8 + 2**-40, 1 + 2**-8, -(1 + 3 * 2**-8), 1 + 3 * 2**-8 - 2**-45])
    assert list(cast(d, FLOAT64, BFLOAT16, bf16).astype(np.float64)) == \
        [1 + 2**-7, 1.0, -(1 + 2**-6), 1 + 2**-7]
    normal = f64[np.isfinite(f64) & (np.abs(f64) > 2.0**-120) & (np.abs(f64) < 2.0**120)]
    got = cast(normal, FLOAT64, BFLOAT16, bf16).view(np.uint16)
    assert np.array_equal(got, bf16_bits_exact(normal))
    # NaN payloads move like x86's conversions: quieted, top bits kept.
    nan = np.array([0x7FF4_0000_0000_0001], np.uint64).view(np.float64)
    assert cast(nan, FLOAT64, FLOAT16, np.float16).view(np.uint16)[0] == 0x7F00
    with pytest.raises(InvalidInputError, match="not supported"):
        cast(np.zeros(2, np.int32), INT32, FLOAT16, np.float16)


class _FakeCudaArray:
    """Says it lives on CUDA device 1, as a CuPy array or a torch CUDA tensor does."""

    def __dlpack_device__(self):
        return (2, 1)

    def __dlpack__(self, **kwargs):
        raise AssertionError("a GPU array must be refused before it is read")


class _FakeCaiArray:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


@pytest.mark.parametrize("array", [_FakeCudaArray(), _FakeCaiArray()], ids=["dlpack", "cai"])
def test_a_gpu_array_is_refused_with_what_is_missing(array):
    from ringreduce.testing import run_threaded

    def fn(c):
        with pytest.raises(rr.InvalidInputError) as info:
            c.allreduce(array, op=rr.Adasum, name="g")  # Adasum does not run on GPU
        return str(info.value)

    for msg in run_threaded(1, fn, timeout=30):
        assert "allreduce 'g'" in msg and "CUDA" in msg and "memory" in msg, msg
        assert ("NCCL" in msg) and ("driver" in msg or "device" in msg), msg
        assert "x.get()" in msg and ".cpu()" in msg, msg
