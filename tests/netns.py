"""Real hosts for the test tier: network namespaces joined by veth pairs and a bridge.

``Hosts(n)`` (a context manager) makes ``n`` namespaces, each with one interface
``eth0`` whose veth peer is enslaved to a bridge in a namespace of its own (the
"switch"), so the test machine's own network is never touched::

    host0 (10.x.y.1) --veth--+
    host1 (10.x.y.2) --veth--+-- bridge (switch namespace)
    ...

Each namespace counts as a host of its own for ringreduce because every rank
launched in it gets ``RINGREDUCE_HOST_ID=<namespace>`` (namespaces share the
hostname, boot id and PID namespace, so they would otherwise count as one host:
correct for shared memory, but not what a multi-host test wants). Ranks in one
namespace still talk through shared memory; ranks in different ones over TCP
through the bridge.

Cleanup: names embed the creating pid (``rrh-<pid>-<tag>-...``), ``close()`` runs
in a ``finally`` however the test ends, and every ``Hosts()`` first deletes the
namespaces of creators that are no longer alive (a crashed or killed run), so
parallel or crashed runs never collide. Deleting a namespace deletes its veth
ends, and with them their peers.

``cut(i)`` takes host i's link down on the switch side (a cable pulled: no FIN,
no RST, nothing), ``restore(i)`` brings it back.

As a command, it runs one command line in host 0 of ``-n`` fresh hosts and tears
them down after; ``{addrs}`` becomes the hosts' addresses (comma-separated) and
``{launcher}`` an ssh stand-in (``launcher HOST COMMAND``: runs COMMAND in the
namespace of address HOST, with its ``RINGREDUCE_HOST_ID``), e.g. MPICH across
two hosts::

    python tests/netns.py -n 2 mpiexec -hosts {addrs} -launcher ssh \
        -launcher-exec {launcher} -iface eth0 -np 2 python benchmarks/allreduce.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from typing import Optional

import pytest
from procs import pid_alive

PREFIX = "rrh-"
_OWNED = re.compile(rf"^{PREFIX}(\d+)-")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose creating process is gone."""
    res = ip("netns", "list", check=False)
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _OWNED.match(name)
        if m and not pid_alive(int(m.group(1))):
            ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Hosts:
    """``n`` network namespaces on one bridge; see the module docstring."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:6]
        base = f"{PREFIX}{os.getpid()}-{self.tag}"
        self.names = [f"{base}-h{i}" for i in range(n)]
        self.switch = f"{base}-sw"
        net = 16 + int(self.tag[:2], 16) % 200
        sub = int(self.tag[2:4], 16)
        self.addrs = [f"10.{net}.{sub}.{i + 1}" for i in range(n)]
        self._ports = [f"rrh{self.tag}p{i}" for i in range(n)]  # switch-side veth ends
        self._made: list[str] = []

    # ------------------------------------------------------------ lifetime
    def __enter__(self) -> Hosts:
        if not shutil.which("ip"):
            pytest.skip("iproute2 (ip) is not installed")
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        res = ip("netns", "add", self.switch, check=False)
        if res.returncode != 0:
            pytest.skip(f"cannot create network namespaces here: {res.stderr.strip()}")
        self._made.append(self.switch)
        sw = ("-n", self.switch)
        for step in [("link", "add", "br0", "type", "bridge"), ("link", "set", "br0", "up")]:
            self._step(*sw, *step)
        for name, port, addr in zip(self.names, self._ports, self.addrs):
            ip("netns", "add", name)
            self._made.append(name)
            inner = f"rrh{self.tag}e"
            self._step("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                       inner)
            self._step("-n", self.switch, "link", "set", inner, "netns", name)
            self._step("-n", name, "link", "set", inner, "name", "eth0")
            self._step("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._step("-n", name, "link", "set", "eth0", "up")
            self._step("-n", name, "link", "set", "lo", "up")
            self._step(*sw, "link", "set", port, "master", "br0")
            self._step(*sw, "link", "set", port, "up")

    def _step(self, *args: str) -> None:
        res = ip(*args, check=False)
        if res.returncode != 0:
            pytest.skip(f"cannot set up namespace networking: ip {' '.join(args)}: "
                        f"{res.stderr.strip()}")

    def close(self) -> None:
        """Delete every namespace made (idempotent; errors ignored)."""
        for name in reversed(self._made):
            ip("netns", "del", name, check=False)
        self._made.clear()

    # ---------------------------------------------------------------- links
    def cut(self, i: int) -> None:
        """Take host i's cable out: its switch port goes down, nothing is sent."""
        ip("-n", self.switch, "link", "set", self._ports[i], "down")

    def restore(self, i: int) -> None:
        ip("-n", self.switch, "link", "set", self._ports[i], "up")

    # ------------------------------------------------------------- launches
    def command(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside host i."""
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def env_launch(self, placement: Sequence[int], cmd: Sequence[str],
                   env: Optional[Mapping[str, str]] = None, port: int = 29400,
                   master: int = 0) -> list[tuple[str, list[str], dict[str, str]]]:
        """run_procs specs for the env-var launch of rank r on host ``placement[r]``.

        Every rank gets RANK/WORLD_SIZE/LOCAL_RANK, MASTER_ADDR (host ``master``'s
        address) and MASTER_PORT, and ``RINGREDUCE_HOST_ID`` naming its namespace.
        ``env`` is the base environment (e.g. ``procs.base_env(...)``).
        """
        specs = []
        n = len(placement)
        for r, h in enumerate(placement):
            local = sum(1 for q in placement[:r] if q == h)
            e = dict(env or os.environ)
            e.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(local),
                     MASTER_ADDR=self.addrs[master], MASTER_PORT=str(port),
                     RINGREDUCE_HOST_ID=self.names[h])
            specs.append((f"rank {r} (host {h})", self.command(h, cmd), e))
        return specs


_LAUNCHER = """#!/bin/sh
# ssh stand-in: [options] HOST COMMAND... runs COMMAND in the namespace of address HOST
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%s
*) echo "unknown host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" env RINGREDUCE_HOST_ID="$ns" sh -c "$*"
"""


def write_launcher(hosts: Hosts, path: str) -> str:
    """Write the ssh stand-in for ``hosts`` (``launcher ADDRESS COMMAND``) to ``path``."""
    cases = "\n".join(f'{a}) ns={n};;' for a, n in zip(hosts.addrs, hosts.names))
    with open(path, "w") as f:
        f.write(_LAUNCHER % cases)
    os.chmod(path, 0o755)
    return path


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[0] != "-n":
        print(__doc__, file=sys.stderr)
        return 2
    with Hosts(int(argv[1])) as hosts, tempfile.TemporaryDirectory() as tmp:
        launcher = write_launcher(hosts, os.path.join(tmp, "launcher"))
        cmd = [a.replace("{addrs}", ",".join(hosts.addrs)).replace("{launcher}", launcher)
               for a in argv[2:]]
        env = dict(os.environ, RINGREDUCE_HOST_ID=hosts.names[0])
        return subprocess.run(hosts.command(0, cmd), env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
