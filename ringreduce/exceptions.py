"""Exception classes of ringreduce.

The C++ core raises these too: ``ringreduce._core`` maps each error kind to the
class of the same name here, so user code needs a single ``except`` clause.
"""

from __future__ import annotations

from typing import Optional


def call_label(op: str, name: Optional[str]) -> str:
    """How error messages name a call: ``allreduce 'grad'`` or just ``allreduce``."""
    return f"{op} '{name}'" if name else op


class RingReduceError(RuntimeError):
    """Base class of every error raised by ringreduce."""


class NotInitializedError(RingReduceError):
    """A collective or query was used before ``ringreduce.init()``."""


class InvalidInputError(RingReduceError, ValueError):
    """The arguments of a call on this rank are unusable (dtype, layout, root...)."""


class MismatchError(RingReduceError):
    """Ranks called a collective with arguments that do not agree.

    Raised on every rank alike; the message says which rank sent what.
    The library stays usable afterwards.
    """


class PeerLostError(RingReduceError):
    """A peer rank died or its connection failed; the job cannot continue."""


class RingReduceTimeoutError(RingReduceError, TimeoutError):
    """A peer stayed alive but made no progress within the configured timeout."""


# Horovod's exception names (horovod.common.exceptions), for ported scripts. Horovod raises
# HorovodInternalError for every failure of a collective (a lost peer, a mismatch); every
# error ringreduce raises derives from RingReduceError, so the alias is that class and
# ``except hvd.HorovodInternalError`` catches what it caught under Horovod.
HorovodInternalError = RingReduceError


class HostsUpdatedInterrupt(RingReduceError):
    """Horovod's elastic-mode signal that the host set changed.

    ringreduce has no elastic mode, so it never raises this; the name exists so that a
    ported script's ``except hvd.HostsUpdatedInterrupt`` clause still imports.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync
