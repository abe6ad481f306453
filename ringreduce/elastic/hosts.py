"""The elastic driver's blacklist: hosts a worker failed on, and when each may take
workers again (Horovod's ``--blacklist-cooldown-range``).

State of a host::

    usable --a worker fails--> blacklisted (no cooldown range: for good)
       ^         \\
       |          `--(with a range)--> cooling down --its period is over--> usable
       `-------------------------------------------------------------------------'

The n-th time a host is blacklisted it cools down for ``min(MAX, MIN * 2**(n-1) + u * MIN)``
seconds, ``u`` uniform in [0, 1): the first period lies in [MIN, 2 MIN), each later one about
doubles, none is longer than MAX. The random part keeps hosts that failed together (a
network blip) from all coming back in the same instant. A failure while the host cools
down (its other workers, failing with it) neither counts again nor extends the period.
Whether a host is usable changes only in ``expire()``, which the driver's main loop calls,
so between two calls the driver sees one consistent blacklist.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

from ..exceptions import InvalidInputError

__all__ = ["Blacklist", "check_cooldown_range"]


def check_cooldown_range(value: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """Validate a cooldown range ``(MIN, MAX)`` in seconds.

    Parameters
    ----------
    value : (float, float) or None
        ``--blacklist-cooldown-range MIN MAX`` / ``ringreduce.run(cooldown_range=...)``;
        None means no cooldown (a blacklisted host stays out).

    Returns
    -------
    (float, float) or None
        The range as floats.

    Raises
    ------
    InvalidInputError
        Unless ``0 < MIN <= MAX`` (both finite).
    """
    if value is None:
        return None
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidInputError(f"the blacklist cooldown range must be two numbers of "
                                f"seconds (MIN MAX), not {value!r}") from None
    if not (0 < low <= high and math.isfinite(high)):
        raise InvalidInputError(f"the blacklist cooldown range needs 0 < MIN <= MAX "
                                f"(seconds), got {low:g} {high:g}")
    return low, high


@dataclass
class _Host:
    times: int = 0  # how often it was blacklisted
    until: float = 0.0  # when it is usable again; 0: usable now, inf: never


class Blacklist:
    """Which hosts may not get workers now, and until when.

    Parameters
    ----------
    cooldown_range : (float, float), optional
        ``(MIN, MAX)`` seconds (see the module docstring); None blacklists for good.
    rand : callable, optional
        Returns a float in [0, 1) (default ``random.random``; tests pass a fixed one).
    """

    def __init__(self, cooldown_range: Optional[tuple[float, float]] = None,
                 rand: Callable[[], float] = random.random) -> None:
        self.range = check_cooldown_range(cooldown_range)
        self.rand = rand
        self.hosts: dict[str, _Host] = {}

    def __contains__(self, host: object) -> bool:
        entry = self.hosts.get(host) if isinstance(host, str) else None
        return entry is not None and entry.until > 0

    def period(self, times: int) -> float:
        """Seconds the ``times``-th blacklisting lasts (inf without a cooldown range)."""
        if self.range is None:
            return math.inf
        low, high = self.range
        grown = low * 2.0 ** min(times - 1, 60)  # capped exponent: no overflow
        return min(high, grown + self.rand() * low)

    def add(self, host: str, now: float) -> Optional[float]:
        """Blacklist ``host`` at time ``now`` (``time.monotonic()``).

        Returns
        -------
        float or None
            Seconds until it is usable again (inf: never); None if it already was
            blacklisted (nothing changes).
        """
        entry = self.hosts.setdefault(host, _Host())
        if entry.until > 0:
            return None
        entry.times += 1
        seconds = self.period(entry.times)
        entry.until = now + seconds
        return seconds

    def times(self, host: str) -> int:
        """How often ``host`` was blacklisted."""
        entry = self.hosts.get(host)
        return entry.times if entry else 0

    def expire(self, now: float) -> list[str]:
        """Make usable again the hosts whose cooldown is over; return them."""
        back = [h for h, e in self.hosts.items() if 0 < e.until <= now]
        for h in back:
            self.hosts[h].until = 0.0  # ``times`` stays: the next period is longer
        return back

    def cooling(self, now: float) -> dict[str, float]:
        """Hosts that are blacklisted for a while only, with the seconds they have left."""
        return {h: max(0.0, e.until - now) for h, e in self.hosts.items()
                if 0 < e.until < math.inf}
