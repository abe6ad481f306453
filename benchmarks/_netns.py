"""Hosts made of Linux network namespaces, for benchmarks that need real links between hosts.

``Hosts(n, rate="1gbit")`` creates ``n`` namespaces, each with one veth pair whose other end
sits on a bridge in a switch namespace of its own (the machine's own network is not touched),
addresses 10.<net>.<k>.0/24, and optionally shapes every link with ``tc qdisc ... tbf`` in both
directions (the host's upload on its end, its download on the switch's end), as a NIC of that
rate would be. Everything is removed in ``close()`` (also when the ``with`` block fails); names
carry this process's PID so that ``cleanup_leftovers()`` can remove what a killed run left
behind without touching another live run's namespaces. Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from typing import Optional

PREFIX = "rrbench"


class NetnsError(RuntimeError):
    """Namespaces, veth pairs, bridges or tbf are not available here (the reason is the text)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``; raise NetnsError with its stderr on failure when ``check``."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _tc(ns: str, dev: str, rate: str) -> None:
    bits = rate_bits(rate)
    # A burst of 2 ms at the rate (at least 64 KiB): large enough for GSO segments and for
    # the timer to keep the link busy, small enough not to inflate a measured rate.
    burst = max(64 << 10, int(bits / 8 * 0.002))
    cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", rate, "burst", str(burst), "latency", "20ms"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {res.stderr.strip()}")


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit`` or ``500mbit``."""
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r} is not like 1gbit, 10gbit, 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def available() -> Optional[str]:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe{uuid.uuid4().hex[:4]}"
    res = ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create network namespaces: {res.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def cleanup_leftovers() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone; returns their names."""
    gone = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class Hosts:
    """``n`` namespaces joined by a bridge; ``names[k]`` and ``addrs[k]`` describe host k.

    Parameters
    ----------
    n : int
        Number of hosts.
    rate : str, optional
        tc rate of every link in each direction (``1gbit``, ``10gbit``); unshaped if None.
    mtu : int
        MTU of every link.
    """

    def __init__(self, n: int, rate: Optional[str] = None, mtu: int = 1500) -> None:
        tag = uuid.uuid4().hex[:6]
        self.rate = rate
        self.names = [f"{PREFIX}-{os.getpid()}-{tag}h{k}" for k in range(n)]
        self.switch = f"{PREFIX}-{os.getpid()}-{tag}sw"
        net = 16 + int(tag[:2], 16) % 200
        self.addrs = [f"10.232.{net}.{k + 1}" for k in range(n)]
        self._made: list[str] = []
        try:
            self._build(tag, mtu)
        except BaseException:
            self.close()
            raise

    def _build(self, tag: str, mtu: int) -> None:
        for ns in [self.switch, *self.names]:
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for k, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            host_end, port = f"rr{tag}h{k}", f"rr{tag}p{k}"
            ip("link", "add", host_end, "mtu", str(mtu), "type", "veth", "peer", "name", port,
               "mtu", str(mtu))
            ip("link", "set", host_end, "netns", ns)
            ip("link", "set", port, "netns", self.switch)
            ip("-n", ns, "link", "set", host_end, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")
            if self.rate:
                _tc(ns, "eth0", self.rate)
                _tc(self.switch, port, self.rate)

    def exec_prefix(self, k: int) -> list[str]:
        """The command prefix that runs a program on host ``k``."""
        return ["ip", "netns", "exec", self.names[k]]

    def close(self) -> None:
        """Delete every namespace (their veth ends and the bridge go with them)."""
        for ns in reversed(self._made):
            ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn(hosts: Hosts, placement: Sequence[int], argv: Sequence[str], env: dict
          ) -> list[subprocess.Popen]:
    """Start one process per rank, rank r on host ``placement[r]``, with the env-var launch
    (RANK, WORLD_SIZE, MASTER_ADDR on host 0, RINGREDUCE_HOST_ID per namespace: the
    namespaces share hostname and boot id, so without it they would count as one host)."""
    procs = []
    for r, h in enumerate(placement):
        e = {**env, "RANK": str(r), "WORLD_SIZE": str(len(placement)),
             "MASTER_ADDR": hosts.addrs[placement[0]],
             "RINGREDUCE_HOST_ID": hosts.names[h]}
        procs.append(subprocess.Popen([*hosts.exec_prefix(h), *argv], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs
