"""Ranks' output back on the driver, as Horovod's ``horovod.spark.run`` shows it.

A task's ``print`` would land in its executor's log, far from the notebook that started the
job. The driver listens on a port of its own (``OutputRelay``); each task opens one
connection per stream, says which rank and stream it carries and proves it belongs to this
job (a digest of the job's secret, not the secret), then writes lines to it while ``fn``
runs (``relayed``). The driver copies them whole, prefixed ``[rank]: `` like ``ringrun``, to
the caller's ``stdout`` / ``stderr``. Only Python's ``sys.stdout`` / ``sys.stderr`` travel;
what C code writes to the file descriptors stays in the executor's log. A task that cannot
reach the driver keeps its own streams and says so there: output is never worth a failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import socket
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any, Union

from ..launcher import _binary, _pump

_STREAMS = ("stdout", "stderr")


def _token(secret: str) -> str:
    return hashlib.sha256(f"ringreduce-output:{secret}".encode()).hexdigest()


class OutputRelay:
    """The driver's end: accepts the tasks' connections and copies their lines."""

    def __init__(self, host: str, secret: str, stdout: IO, stderr: IO, stamp: bool) -> None:
        self._server = socket.create_server(("", 0))
        self.address = (host, self._server.getsockname()[1])
        self._token = _token(secret)
        self._writers = {"stdout": _binary(stdout), "stderr": _binary(stderr)}
        self._stamp, self._lock = stamp, threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True,
                                           name="ringreduce-spark-output")
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._pumps.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            pipe = conn.makefile("rb")
            token, _, rest = pipe.readline().decode(errors="replace").strip().partition(" ")
            label, _, stream = rest.partition(" ")
            if token != self._token or stream not in _STREAMS or not label:
                return  # not one of this job's tasks
            conn.settimeout(None)
            _pump(pipe, self._writers[stream], f"[{label}]: ".encode(), self._lock,
                  stamp=self._stamp)

    def close(self, wait: float = 5.0) -> None:
        """Stop accepting; give the open connections ``wait`` seconds to end."""
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close does not)
        self._server.close()
        self._accepting.join(wait)
        for t in list(self._pumps):
            t.join(wait)


@contextlib.contextmanager
def relayed(address: tuple[str, int], secret: str, label: Union[int, str]) -> Iterator[None]:
    """The task's end: ``sys.stdout`` and ``sys.stderr`` go to the driver meanwhile, each
    line to be prefixed ``[label]: `` there (a rank; an elastic worker's id)."""
    saved = sys.stdout, sys.stderr
    opened: list[Any] = []
    try:
        for name in _STREAMS:
            conn = socket.create_connection(address, timeout=10)
            conn.settimeout(None)
            stream = io.TextIOWrapper(conn.makefile("wb"), encoding="utf-8",
                                      errors="replace", line_buffering=True)
            opened.append((conn, stream))
            stream.write(f"{_token(secret)} {label} {name}\n")
            setattr(sys, name, stream)
    except OSError as e:
        sys.stdout, sys.stderr = saved
        print(f"ringreduce.spark: [{label}] cannot send its output to the driver at "
              f"{address[0]}:{address[1]} ({e}); it stays here", file=sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for conn, stream in opened:
            with contextlib.suppress(OSError, ValueError):
                stream.close()
            conn.close()
