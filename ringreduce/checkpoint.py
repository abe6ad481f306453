"""Atomic checkpoint files, independent of any framework.

A checkpoint is written to a temporary file in the target's directory, flushed
to disk (``fsync``), renamed over the target (atomic on POSIX file systems) and
the directory entry is flushed too. A crash or ``kill -9`` at any moment leaves
either the previous checkpoint or the new one, never a torn file::

    from ringreduce.checkpoint import atomic_write

    atomic_write("ckpt.npz", lambda f: np.savez(f, w=w))

Framework helpers (``ringreduce.torch.save_checkpoint``) add the rank-0-only
policy and the load-on-rank-0-then-broadcast side on top of this.
"""

from __future__ import annotations

import os
from typing import IO, Callable

from .exceptions import RingReduceError

__all__ = ["CheckpointError", "atomic_write", "fsync_dir", "remove_stale_temp_files"]


class CheckpointError(RingReduceError):
    """A checkpoint could not be written, found or read.

    ``load_checkpoint`` raises it on every rank alike, with rank 0's reason.
    """


def _temp_path(path: str) -> str:
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{os.getpid()}.tmp")


def _open_temp(tmp: str) -> IO[bytes]:
    """Open the temporary file (a seam for tests that kill the writer mid-write)."""
    return open(tmp, "wb")  # open() honours the umask, unlike mkstemp's 0600


def fsync_dir(directory: str) -> None:
    """Flush a directory's entries (e.g. a rename inside it) to disk, where the OS allows.

    Parameters
    ----------
    directory : str
        Directory to sync.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(path: str) -> list[str]:
    """Delete temporary files of ``path`` left by writers that died mid-save.

    Only files named like this module's temporaries whose writer process no
    longer exists are removed, so a concurrent writer is never disturbed.

    Parameters
    ----------
    path : str
        The checkpoint path (not the temporary file).

    Returns
    -------
    list of str
        The removed files.
    """
    directory, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}."
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):-len(".tmp")] if name.startswith(prefix) else ""
        if name.endswith(".tmp") and pid.isdigit() and int(pid) != os.getpid() \
                and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except OSError:
                pass
    return removed


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file atomically: temp file in the same directory, fsync, rename, fsync dir.

    Parameters
    ----------
    path : str
        Final path. Its directory is created if missing.
    write : callable
        ``write(f)`` writes the whole content to the binary file object ``f``.

    Raises
    ------
    CheckpointError
        The directory or file could not be written (the previous file, if any,
        is untouched and the temporary file is removed).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = _temp_path(path)
    try:
        os.makedirs(directory, exist_ok=True)
        remove_stale_temp_files(path)
        with _open_temp(tmp) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise CheckpointError(f"cannot write checkpoint {path!r}: {err}") from err
        raise
    fsync_dir(directory)
