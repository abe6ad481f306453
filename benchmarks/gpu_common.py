"""What the GPU benchmarks share: the GPU check, the choice of this rank's GPU, and
torch.distributed's NCCL process group next to ringreduce (rank 0's address through
ringreduce's object broadcast, so no MPI is needed)."""

from __future__ import annotations

import os
import socket
import sys

import ringreduce as rr


def require_gpu(program: str) -> None:
    """Exit with status 2 and the reason unless a CUDA device and NCCL are usable."""
    info = rr.gpu_info()
    missing = info["cuda_error"] or ("" if info["cuda_device_count"] else "no CUDA device")
    if not missing and not info["nccl_version"]:
        missing = f"no NCCL ({info['nccl_error']})"
    if missing:
        print(f"{program}: needs one CUDA GPU per rank and NCCL; {missing}", file=sys.stderr)
        sys.exit(2)


def this_rank_gpu() -> tuple[int, int]:
    """(this rank's GPU ordinal, the GPUs this process sees); ringreduce initialised.

    Ranks share GPUs when a host has fewer GPUs than ranks (one lent GPU). NCCL refuses
    that within one host, so each rank then claims a host of its own and every byte goes
    over NCCL's loopback sockets: a check that everything runs, not a GPU's speed.
    """
    gpus = rr.gpu_info()["cuda_device_count"]
    if rr.local_size() > gpus:
        os.environ["NCCL_HOSTID"] = f"rr-bench-{rr.rank()}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return rr.local_rank() % gpus, gpus


def init_torch_nccl(device: int) -> None:
    """torch.distributed's NCCL process group over ringreduce's ranks, on GPU ``device``."""
    import torch
    import torch.distributed as dist

    addr = "127.0.0.1" if rr.cross_size() == 1 else socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    addr, port = rr.broadcast_object((addr, port), root_rank=0, name="bench.tcp")
    dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}", rank=rr.rank(),
                            world_size=rr.size(), device_id=torch.device("cuda", device))
