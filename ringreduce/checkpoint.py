"""Atomic checkpoint files, independent of any framework.

A checkpoint is written to a temporary file in the target's directory, flushed
to disk (``fsync``), renamed over the target (atomic on POSIX file systems) and
the directory entry is flushed too. A crash or ``kill -9`` at any moment leaves
either the previous checkpoint or the new one, never a torn file::

    from ringreduce.checkpoint import atomic_write

    atomic_write("ckpt.npz", lambda f: np.savez(f, w=w))

The rank-0 policy is here too, for every framework layer: ``save_on_root`` writes on
one rank only, ``load_on_root`` reads on one rank and broadcasts what it read (or
its reason for failing) to every rank. ``ringreduce.torch``, ``ringreduce.tensorflow``
and ``ringreduce.keras`` plug their file formats into them.
"""

from __future__ import annotations

import os
from typing import IO, Any, Callable, Optional

from .exceptions import RingReduceError

__all__ = ["CheckpointError", "atomic_save_path", "atomic_write", "fsync_dir", "load_on_root",
           "read_pickled_dict", "remove_stale_temp_files", "save_on_root"]


class CheckpointError(RingReduceError):
    """A checkpoint could not be written, found or read.

    ``load_checkpoint`` raises it on every rank alike, with rank 0's reason.
    """


def _temp_path(path: str, suffix: str = "") -> str:
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{os.getpid()}.tmp{suffix}")


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
        # .<base>.<pid>.tmp, or .<base>.<pid>.tmp<suffix> (atomic_save_path)
        pid, tmp, _ = name[len(prefix):].partition(".tmp") if name.startswith(prefix) \
            else ("", "", "")
        if tmp and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
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
    def save(tmp: str) -> None:
        with _open_temp(tmp) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())

    _replace_atomically(path, save, "", synced=True)


def atomic_save_path(path: str, save: Callable[[str], None], suffix: str = "") -> None:
    """``atomic_write`` for writers that need a file name (``keras.Model.save``, which
    insists on a ``.keras`` suffix): ``save(tmp)`` writes a temporary file beside
    ``path`` whose name ends in ``suffix``; it is fsynced and renamed over ``path``.

    Parameters
    ----------
    path : str
        Final path; its directory is created if missing.
    save : callable
        ``save(tmp_path)`` writes the whole file.
    suffix : str
        What the temporary file's name must end with (e.g. ``".keras"``).
    """
    _replace_atomically(path, save, suffix, synced=False)


def _replace_atomically(path: str, save: Callable[[str], None], suffix: str,
                        synced: bool) -> None:
    """The protocol of both writers: remove dead writers' temporaries, ``save(tmp)``,
    fsync it (unless ``save`` did), rename over ``path``, fsync the directory; on any
    failure the temporary file goes and ``path`` is untouched."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = _temp_path(path, suffix)
    try:
        os.makedirs(directory, exist_ok=True)
        remove_stale_temp_files(path)
        save(tmp)
        if not synced:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
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


def save_on_root(comm: Any, path: str, root_rank: int, write: Callable[[IO[bytes]], None]) -> bool:
    """Write ``path`` atomically on ``root_rank`` only; other ranks return False at once.

    Not collective.

    Parameters
    ----------
    comm : Communicator
        Tells this rank.
    path : str
        Target file.
    root_rank : int
        The rank that writes.
    write : callable
        ``write(f)`` writes the content to a binary file object.

    Returns
    -------
    bool
        True on the rank that wrote the file.
    """
    if comm.rank() != root_rank:
        return False
    atomic_write(path, write)
    return True


def load_on_root(comm: Any, path: str, root_rank: int, read: Callable[[str], Any],
                 missing_ok: bool = False) -> Optional[Any]:
    """Read ``path`` on ``root_rank`` with ``read(path)`` and return what it read on every rank.

    Collective. Only the root opens the file; the others need not see it. Any
    failure of ``read`` (its exception's message; a ``CheckpointError``'s message as
    it is) reaches every rank as the same ``CheckpointError``.

    Parameters
    ----------
    comm : Communicator
        The ranks.
    path : str
        The checkpoint file.
    root_rank : int
        The rank that reads.
    read : callable
        ``read(path)`` returns the (picklable) contents or raises.
    missing_ok : bool
        Return None on every rank if the file does not exist.

    Raises
    ------
    CheckpointError
        On every rank alike, if the file is missing or ``read`` failed.
    """
    error, missing, data = None, False, None
    if comm.rank() == root_rank:
        if not os.path.exists(path):
            error, missing = f"no checkpoint at {path!r}", True
        else:
            try:
                data = read(path)
            except CheckpointError as err:  # the reader's own words
                error = str(err)
            except Exception as err:  # any failure must reach every rank
                error = f"cannot read checkpoint {path!r}: {type(err).__name__}: {err}"
    error, missing, data = comm.broadcast_object((error, missing, data), root_rank,
                                                 name="load_checkpoint")
    if missing and missing_ok:
        return None
    if error is not None:
        raise CheckpointError(f"load_checkpoint on rank {comm.rank()}: rank {root_rank} "
                              f"reports: {error}")
    return data


def read_pickled_dict(path: str) -> dict:
    """The dict a layer's ``save_checkpoint`` pickled into ``path`` (``load_on_root``'s
    ``read`` for the TensorFlow and JAX layers); CheckpointError if it holds anything else."""
    import pickle

    with open(path, "rb") as f:
        data = pickle.load(f)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path!r} is not a checkpoint written by save_checkpoint()")
    return data
