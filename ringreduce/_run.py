"""``ringreduce.run``: call a function on new ranks and collect what it returns (Horovod's
``horovod.run``), in a fixed-size job or an elastic one."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from . import _horovodrun
from ._horovod_settings import elastic_timeout
from ._task_world import error_record, last_generation, reraise
from .exceptions import InvalidInputError, RingReduceError
from .launcher import (
    TIMEOUT_EXIT_CODE,
    HostSlots,
    OutputSettings,
    launch,
    parse_hostfile,
    parse_hosts,
    ssh_with_identity,
)

__all__ = ["run", "run_pickled"]


_HOROVOD_REFUSED = ("mpi_args",)
_HOROVOD_ELASTIC = ("min_num_proc", "max_num_proc", "min_np", "max_np", "slots",
                    "reset_limit", "elastic_timeout", "host_discovery_script", "cooldown_range")


def run(fn: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None, np: Optional[int] = None,
        hosts: Optional[str | Sequence[HostSlots]] = None, timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None, *, num_proc: Optional[int] = None,
        hostfile: Optional[str | os.PathLike] = None, ssh_port: Optional[int] = None,
        executable: Optional[str] = None, use_gloo: Optional[bool] = None,
        use_mpi: Optional[bool] = None, verbose: Any = None, disable_cache: Any = None,
        start_timeout: Optional[float] = None, network_interface: Optional[str] = None,
        ssh_identity_file: Optional[str] = None, output_filename: Optional[str] = None,
        **horovod: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``np`` new ranks; return their values in rank order.

    Like ``horovod.run``: ``fn`` runs in fresh processes started as by ``ringrun`` and
    must call ``ringreduce.init()`` itself. ``fn``, its arguments and its return value
    travel by pickle (through a temporary directory, which remote hosts must share);
    a function of the ``__main__`` script is found by re-running the script with
    ``__name__ == "__mp_main__"``, as multiprocessing's spawn does, so guard its entry
    point with ``if __name__ == "__main__":``.

    Parameters
    ----------
    fn : callable
        A picklable function (module level).
    args, kwargs : optional
        Its arguments.
    np : int, optional
        Number of ranks (default 1, as ``horovod.run``'s ``num_proc``).
    hosts : str or sequence of HostSlots, optional
        ``"host1:2,host2:2"`` or parsed entries; default all local.
    timeout : float, optional
        Seconds before the job is stopped (then RingReduceTimeoutError).
    env : mapping, optional
        Extra environment variables for the ranks.
    num_proc, hostfile, ssh_port, executable :
        Horovod's names: ``num_proc`` is ``np``; ``hostfile`` a file of ``host slots=N``
        (or ``host:N``) lines, not with ``hosts``; ``ssh_port`` the port of remote ranks'
        ssh; ``executable`` the Python that runs the ranks (default ``sys.executable``).
    start_timeout, network_interface, ssh_identity_file, output_filename, verbose :
        As ``ringrun``'s ``--start-timeout`` (seconds the ranks wait for each other),
        ``--network-interfaces`` (one interface), ``-i``, ``--output-filename`` (each
        rank's output also in ``<dir>/rank.<N>/stdout`` and ``stderr``; ``worker.<N>`` in
        an elastic job) and ``--verbose``.
    use_gloo, use_mpi, disable_cache :
        Horovod's; accepted and ignored (ringreduce has its own transport; both
        ``use_gloo`` and ``use_mpi`` true is refused, as Horovod does).
    **horovod :
        Horovod's elastic arguments make the job elastic, as ``ringrun``'s flags of the
        same names: ``min_num_proc`` / ``min_np``, ``max_num_proc`` / ``max_np``,
        ``slots`` (per discovered host), ``reset_limit``, ``elastic_timeout``,
        ``host_discovery_script``, ``cooldown_range`` (``(min, max)`` seconds, as
        ``--blacklist-cooldown-range``); ``fn`` then uses ``ringreduce.elastic.run``
        itself. ``mpi_args`` is refused when set; any other name is a TypeError.

    Returns
    -------
    list
        ``fn``'s return value on each rank, in rank order (in an elastic job: on each
        rank of the last generation).

    Raises
    ------
    Exception
        The exception of the first rank that raised one, with that rank's traceback
        text as its ``__cause__``; RingReduceError if a rank died without one.
    """
    unknown = sorted(set(horovod) - set(_HOROVOD_REFUSED) - set(_HOROVOD_ELASTIC))
    if unknown:
        raise TypeError(f"run() got an unexpected keyword argument {unknown[0]!r}")
    refused = sorted(k for k in _HOROVOD_REFUSED if horovod.get(k) is not None)
    if refused:
        raise InvalidInputError(f"ringreduce.run: {', '.join(refused)} not supported (no "
                                "mpirun underneath: ringreduce starts the ranks itself)")
    if use_gloo and use_mpi:
        raise InvalidInputError("ringreduce.run: use_gloo and use_mpi cannot both be true")
    if np is not None and num_proc is not None and np != num_proc:
        raise InvalidInputError(f"ringreduce.run: np={np} and num_proc={num_proc} differ")
    if hosts is not None and hostfile is not None:
        raise InvalidInputError("ringreduce.run: give hosts or hostfile, not both")
    np = np if np is not None else num_proc
    host_list = parse_hosts(hosts) if isinstance(hosts, str) else hosts
    if hostfile is not None:
        host_list = parse_hostfile(hostfile)
    elastic = {k: v for k, v in horovod.items() if k in _HOROVOD_ELASTIC and v is not None}
    common = {"env": {**_horovodrun.run_env(start_timeout, network_interface), **(env or {})},
              "timeout": timeout, "ssh_port": ssh_port,
              "output": OutputSettings(output_filename, verbose=bool(verbose)),
              "ssh_command": ssh_with_identity(ssh_identity_file) if ssh_identity_file else None}
    with tempfile.TemporaryDirectory(prefix="ringreduce-run-") as tmp:
        command = [executable or sys.executable, "-m", "ringreduce", "--run-pickled",
                   _payload(Path(tmp), fn, args, kwargs)]
        if elastic:
            code, failed = _launch_elastic(command, np, host_list, elastic, common), None
        else:
            np = 1 if np is None else np  # horovod.run's num_proc default
            outcome = launch(command, np, host_list, **common)
            code, failed = outcome.code, outcome.failed_rank
        results = _results(Path(tmp))
    return _returned(results, code, failed, None if elastic else np, timeout)


def _payload(tmp: Path, fn: Callable[..., Any], args: Sequence[Any],
             kwargs: Optional[Mapping[str, Any]]) -> str:
    main_mod = sys.modules.get("__main__")
    main_path = getattr(main_mod, "__file__", None) \
        if getattr(fn, "__module__", None) == "__main__" else None
    interactive = getattr(fn, "__module__", None) == "__main__" and not main_path
    dumps = _by_value() if interactive else pickle.dumps
    payload = tmp / "call.pkl"
    with open(payload, "wb") as f:
        pickle.dump({"sys_path": [p or os.getcwd() for p in sys.path],
                     "main_path": main_path and os.path.abspath(main_path),
                     "call": dumps((fn, tuple(args), dict(kwargs or {})))}, f)
    return str(payload)


def _by_value() -> Callable[[Any], bytes]:
    """cloudpickle's ``dumps``, for a function of an interactive ``__main__`` (a notebook,
    ``python -c``): no script exists to import it from, so it travels by value."""
    for name in ("cloudpickle", "pyspark.cloudpickle", "ray.cloudpickle"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module.dumps
    raise InvalidInputError("ringreduce.run: fn was defined interactively (a notebook or "
                            "python -c), so it must travel by value: pip install cloudpickle, "
                            "or define fn in a module")


def _launch_elastic(command: list[str], np: Optional[int],
                    hosts: Optional[Sequence[HostSlots]], elastic: dict,
                    common: dict[str, Any]) -> int:
    from .elastic.discovery import FixedHosts, ScriptHosts
    from .elastic.driver import ElasticSettings, launch_elastic
    from .elastic.hosts import check_cooldown_range

    low = elastic.get("min_num_proc", elastic.get("min_np"))
    high = elastic.get("max_num_proc", elastic.get("max_np"))
    np = np or low or high or 1
    script = elastic.get("host_discovery_script")
    if script and hosts:
        raise InvalidInputError("ringreduce.run: give host_discovery_script or hosts, not both")
    discovery = ScriptHosts(script, elastic.get("slots") or 1) if script else \
        FixedHosts(hosts or [HostSlots("localhost", high or np)])
    settings = ElasticSettings(min_np=low or np, max_np=high or np, np=np,
                               elastic_timeout=elastic_timeout(elastic.get("elastic_timeout")),
                               reset_limit=elastic.get("reset_limit"),
                               cooldown_range=check_cooldown_range(
                                   elastic.get("cooldown_range")))
    return launch_elastic(command, discovery, settings, **common)


def _results(tmp: Path) -> list[dict]:
    out = []
    for path in sorted(tmp.glob("result-*.pkl")):
        with open(path, "rb") as f:
            out.append(pickle.load(f))
    return out


def _returned(results: list[dict], code: int, failed_rank: Optional[int],
              np: Optional[int], timeout: Optional[float]) -> list:
    """The values in rank order, or the first failed rank's exception raised again. In an
    elastic job (``np`` None) only the last generation's ranks count."""
    from .exceptions import RingReduceTimeoutError

    if np is None and results:
        results = last_generation(results)
        if results[0]["generation"] is None:  # no worker got into a generation
            for r in results:
                if not r["ok"]:
                    reraise(r, "a worker that joined no generation")
    by_rank = {r["rank"]: r for r in results}
    for r in ([failed_rank] if failed_rank is not None else []) + sorted(by_rank):
        if r in by_rank and not by_rank[r]["ok"]:
            reraise(by_rank[r], f"rank {r}")
    if code == TIMEOUT_EXIT_CODE and failed_rank is None:
        raise RingReduceTimeoutError(f"ringreduce.run: timed out after {timeout:g} s")
    expected = np if np is not None else len(by_rank)
    if code != 0 or sorted(by_rank) != list(range(expected)) or not by_rank:
        who = f"rank {failed_rank}" if failed_rank is not None else "the job"
        raise RingReduceError(f"ringreduce.run: {who} ended with exit code {code} "
                              "and no result")
    return [by_rank[r]["value"] for r in range(expected)]


def _import_main(path: str) -> None:
    """Load the caller's ``__main__`` script as multiprocessing's spawn does."""
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def run_pickled(path: str) -> int:
    """Rank side of ``run``: call the pickled function, write its result next to it (named
    by rank, or by elastic worker with the rank and generation it ended in)."""
    from .elastic import _client

    with open(path, "rb") as f:
        payload = pickle.load(f)
    sys.path[:0] = [p for p in payload["sys_path"] if p not in sys.path]
    try:
        if payload["main_path"]:
            _import_main(payload["main_path"])
        fn, args, kwargs = pickle.loads(payload["call"])
        record: dict = {"ok": True, "value": fn(*args, **kwargs)}
        code = 0
    except Exception as e:
        record = error_record(e)
        sys.stderr.write(record["traceback"])
        code = 1
    if _client.in_elastic_job():
        name = _client.worker_id()
        rank, generation = _client.Membership.rank, _client.Membership.generation
    else:
        rank, generation = int(os.environ.get("RANK", "0")), 0
        name = str(rank)
    blob = pickle.dumps({**record, "rank": rank, "generation": generation})
    out = Path(path).with_name(f"result-{name}.pkl")
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, out)
    return code
