"""Where an elastic job's hosts come from: a fixed list, or a discovery script run every
second (Horovod's ``--host-discovery-script``: it prints ``host:slots`` or ``host`` lines;
a host without a count gets ``--slots-per-host``)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Optional

from ..exceptions import InvalidInputError
from ..launcher import HostSlots, _say, parse_hosts

__all__ = ["Discovery", "FixedHosts", "ScriptHosts"]


class Discovery:
    """The current host list, polled by the driver."""

    def poll(self) -> Optional[list[HostSlots]]:
        """The hosts now, or None when they cannot be told (keep the last list)."""
        raise NotImplementedError


class FixedHosts(Discovery):
    """A host list that never changes (``-H`` / ``--hostfile`` with ``--min-np``)."""

    def __init__(self, hosts: Sequence[HostSlots]) -> None:
        self.hosts = list(hosts)

    def poll(self) -> Optional[list[HostSlots]]:
        return list(self.hosts)


class ScriptHosts(Discovery):
    """Runs ``script`` and parses its output; a failing script keeps the last list.

    Parameters
    ----------
    script : str
        A shell command line.
    slots_per_host : int
        Slots of a line without ``:slots``.
    timeout : float
        Seconds the script may take.
    """

    def __init__(self, script: str, slots_per_host: int = 1, timeout: float = 30.0) -> None:
        self.script, self.slots, self.timeout = script, slots_per_host, timeout
        self.last_error = ""

    def poll(self) -> Optional[list[HostSlots]]:
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                  timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return self._failed(f"took more than {self.timeout:g} s")
        if done.returncode != 0:
            stderr = done.stderr.strip()[-300:]
            return self._failed(f"exited with code {done.returncode}"
                                + (f" ({stderr})" if stderr else ""))
        try:
            hosts = self.parse(done.stdout)
        except InvalidInputError as err:
            return self._failed(f"printed a bad line: {err}")
        self.last_error = ""
        return hosts

    def parse(self, text: str) -> list[HostSlots]:
        """``host:slots`` or ``host`` per line (blank lines and ``#`` comments skipped)."""
        out: list[HostSlots] = []
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            entry = line if ":" in line else f"{line}:{self.slots}"
            out.extend(parse_hosts(entry))
        return out

    def _failed(self, why: str) -> None:
        if why != self.last_error:  # once per distinct failure, not every second
            _say(f"host discovery script {self.script!r} {why}; keeping the last host list")
        self.last_error = why
        return None
