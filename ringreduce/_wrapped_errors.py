"""Errors of collectives that run inside a framework's compiled code (a TensorFlow graph
op, a JAX host callback), which the framework re-raises wrapped in its own exception type.
The framework layer remembers each RingReduceError as it passes it to the framework and
finds it again by its message in the wrapper, so that the user catches
``PeerLostError`` or ``MismatchError`` itself. Written once for every layer."""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional

from .exceptions import RingReduceError

__all__ = ["find", "remember"]

_lock = threading.Lock()
_recent: deque = deque(maxlen=32)


def remember(err: RingReduceError) -> None:
    """Keep ``err``, raised inside compiled code, to be found by ``find``."""
    with _lock:
        _recent.append(err)


def find(message: str) -> Optional[RingReduceError]:
    """The most recent remembered error whose message the framework's ``message`` holds."""
    with _lock:
        for err in reversed(_recent):
            if str(err) and str(err) in message:
                return err
    return None
