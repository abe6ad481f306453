"""Horovod's settings (``HOROVOD_*`` variables, ``horovodrun``'s tuning flags) as ringreduce's.

A ported job keeps its ``mpirun -x HOROVOD_FUSION_THRESHOLD=... -x HOROVOD_TIMELINE=...``
lines and its ``horovodrun --fusion-threshold-mb 32 --timeline-filename t.json`` flags. One
table says what each Horovod variable becomes:

* a variable with a ringreduce equivalent sets that ``RINGREDUCE_*`` variable, converted
  (Horovod's units and spellings: ``HOROVOD_LOG_LEVEL=TRACE``, booleans as ``1``/``true``),
  unless the user set the ringreduce variable too (an explicit ``RINGREDUCE_*`` wins);
* a variable without one (NCCL streams, MPI threading, ...) changes nothing
  and is named in one warning on rank 0, so nobody believes a knob works that does not;
* anything else starting with ``HOROVOD_`` (the rank variables Horovod's launchers set) is
  left alone.

``init()`` applies the table to ``os.environ`` before the core reads its settings, and
records the names it set in ``RINGREDUCE_FROM_HOROVOD``: a later ``init()`` (an elastic
reset) recomputes those from the Horovod variables instead of taking them for the user's.
``ringrun`` turns its Horovod flags into Horovod variables the way ``horovodrun`` does and
hands the ranks the converted ``RINGREDUCE_*`` ones.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Callable, NamedTuple, Optional

from .exceptions import InvalidInputError

__all__ = [
    "NO_EFFECT",
    "SETTINGS",
    "apply_to_environ",
    "elastic_timeout",
    "translate",
    "warn_no_effect",
]

_RECORD = "RINGREDUCE_FROM_HOROVOD"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_LEVELS = {
    "trace": "debug",
    "debug": "debug",
    "info": "info",
    "warning": "warning",
    "warn": "warning",
    "error": "error",
    "fatal": "error",
}


def _number(kind: type) -> Callable[[str, str], str]:
    def convert(name: str, value: str) -> str:
        try:
            number = kind(value.strip())
        except ValueError:
            number = -1
        if not 0 <= number < math.inf:  # also NaN
            raise InvalidInputError(f"{name}={value!r}: expected a number >= 0")
        return str(number)

    return convert


def _flag(name: str, value: str) -> str:
    v = value.strip().lower()
    if v.lstrip("-").isdigit():  # Horovod reads these with strtol: any non-zero is on
        return "1" if int(v) else "0"
    if v not in _TRUE + _FALSE:
        raise InvalidInputError(f"{name}={value!r}: expected 0 or 1")
    return "1" if v in _TRUE else "0"


def _level(name: str, value: str) -> str:
    level = _LEVELS.get(value.strip().lower())
    if level is None:
        raise InvalidInputError(
            f"{name}={value!r}: expected one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL"
        )
    return level


def _text(name: str, value: str) -> str:
    return value


def _timeline(name: str, value: str) -> str:
    # DYNAMIC: Horovod opens no file until start_timeline(), which ringreduce has too.
    return "" if value.strip().upper() == "DYNAMIC" else value


def _stall_disable(name: str, value: str) -> str:
    return "0" if _flag(name, value) == "1" else ""


class Setting(NamedTuple):
    """One Horovod variable with a ringreduce equivalent."""

    horovod: str
    ringreduce: str
    convert: Callable[[str, str], str]  # (horovod name, value) -> ringreduce value, "" = none
    # (earlier value, this one) -> the value, where two Horovod variables set this one
    combine: Optional[Callable[[str, str], str]] = None


def _longest(earlier: str, this: str) -> str:
    return earlier if float(earlier) >= float(this) else this


# Order matters where two Horovod variables set one ringreduce variable: the later wins
# (a disabled stall check beats a stall time, as in Horovod).
SETTINGS: tuple[Setting, ...] = (
    Setting("HOROVOD_FUSION_THRESHOLD", "RINGREDUCE_FUSION_THRESHOLD", _number(int)),
    Setting("HOROVOD_CYCLE_TIME", "RINGREDUCE_CYCLE_TIME_MS", _number(float)),
    Setting("HOROVOD_CACHE_CAPACITY", "RINGREDUCE_CACHE_CAPACITY", _number(int)),
    Setting("HOROVOD_HIERARCHICAL_ALLREDUCE", "RINGREDUCE_HIERARCHICAL_ALLREDUCE", _flag),
    Setting("HOROVOD_HIERARCHICAL_ALLGATHER", "RINGREDUCE_HIERARCHICAL_ALLGATHER", _flag),
    Setting("HOROVOD_TIMELINE", "RINGREDUCE_TIMELINE", _timeline),
    Setting("HOROVOD_STALL_CHECK_TIME_SECONDS", "RINGREDUCE_STALL_CHECK_SECONDS", _number(float)),
    Setting("HOROVOD_STALL_CHECK_DISABLE", "RINGREDUCE_STALL_CHECK_SECONDS", _stall_disable),
    Setting(
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "RINGREDUCE_STALL_SHUTDOWN_SECONDS", _number(float)
    ),
    Setting("HOROVOD_LOG_LEVEL", "RINGREDUCE_LOG_LEVEL", _level),
    # Horovod's start and Gloo timeouts both bound what ringreduce's connect timeout does:
    # the longer one, so that neither is cut short.
    Setting("HOROVOD_START_TIMEOUT", "RINGREDUCE_CONNECT_TIMEOUT_SECONDS", _number(float)),
    Setting("HOROVOD_GLOO_TIMEOUT_SECONDS", "RINGREDUCE_CONNECT_TIMEOUT_SECONDS", _number(float),
            _longest),
    Setting("HOROVOD_GLOO_IFACE", "RINGREDUCE_IFACE", _text),
    Setting("HOROVOD_DYNAMIC_PROCESS_SETS", "RINGREDUCE_DYNAMIC_PROCESS_SETS", _flag),
    Setting("HOROVOD_TIMELINE_MARK_CYCLES", "RINGREDUCE_TIMELINE_MARK_CYCLES", _flag),
    Setting("HOROVOD_THREAD_AFFINITY", "RINGREDUCE_THREAD_AFFINITY", _text),
    Setting("HOROVOD_AUTOTUNE", "RINGREDUCE_AUTOTUNE", _flag),
    Setting("HOROVOD_AUTOTUNE_LOG", "RINGREDUCE_AUTOTUNE_LOG", _text),
    Setting("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "RINGREDUCE_AUTOTUNE_WARMUP_SAMPLES", _number(int)),
    Setting("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE",
            _number(int)),
    Setting("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "RINGREDUCE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
            _number(int)),
    Setting("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
            "RINGREDUCE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", _number(float)),
)

# Horovod knobs ringreduce has no counterpart for, and why that is safe to say.
NO_EFFECT: dict[str, str] = {
    "HOROVOD_NUM_NCCL_STREAMS": "the GPU backend uses one NCCL stream per device",
    "HOROVOD_MPI_THREADS_DISABLE": "MPI is used only to start the job",
    "HOROVOD_CCL_BGT_AFFINITY": "no oneCCL backend",
    "HOROVOD_CPU_OPERATIONS": "host buffers always use ringreduce's own transports",
    "HOROVOD_GPU_OPERATIONS": "GPU buffers always use NCCL",
    "HOROVOD_CONTROLLER": "negotiation always runs over ringreduce's own transports",
    "HOROVOD_LOG_HIDE_TIME": "log lines carry no time",
    "HOROVOD_DISABLE_GROUP_FUSION": "grouped calls always fuse",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "GPU fusion buffers are packed by one kernel per response",
    "HOROVOD_ENABLE_XLA_OPS": "no XLA ops: collectives are host ops in XLA programs",
}


def translate(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``RINGREDUCE_*`` settings that ``environ``'s Horovod variables ask for.

    Parameters
    ----------
    environ : mapping
        Environment variables (Horovod's among them).

    Returns
    -------
    dict
        ringreduce variable -> value. An empty value means "unset it" (``HOROVOD_TIMELINE=
        DYNAMIC``, a stall check not disabled).

    Raises
    ------
    InvalidInputError
        A Horovod variable's value makes no sense (naming the variable).
    """
    out: dict[str, str] = {}
    for s in SETTINGS:
        if environ.get(s.horovod, "").strip():  # set and not empty, as Horovod reads them
            value = s.convert(s.horovod, environ[s.horovod])
            if value and out.get(s.ringreduce) and s.combine is not None:
                value = s.combine(out[s.ringreduce], value)
            if value or s.ringreduce not in out:
                out[s.ringreduce] = value
    return out


def no_effect(environ: Mapping[str, str]) -> list[str]:
    """The Horovod variables set in ``environ`` that change nothing in ringreduce."""
    return sorted(
        k
        for k, v in environ.items()
        if v.strip() not in _FALSE and k in NO_EFFECT
    )


def apply_to_environ(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the ``RINGREDUCE_*`` variables Horovod's ask for, where the user set none.

    Variables this function set before (listed in ``RINGREDUCE_FROM_HOROVOD``) are
    computed again, so a changed Horovod variable takes effect at the next ``init()``.

    Returns
    -------
    dict
        What it set now.
    """
    ours = set(filter(None, environ.get(_RECORD, "").split(",")))
    for name in ours:
        environ.pop(name, None)
    wanted = translate(environ)
    applied = {k: v for k, v in wanted.items() if v and k not in environ}
    environ.update(applied)
    if applied:
        environ[_RECORD] = ",".join(sorted(applied))
    else:
        environ.pop(_RECORD, None)
    return applied


# The knobs warned about by this process: an elastic job's resets call init() again, and
# the user was told once.
_warned: set[str] = set()


def warn_no_effect(environ: Mapping[str, str], rank: int) -> None:
    """On rank 0, one warning (per process) naming the Horovod knobs that change nothing."""
    names = [n for n in no_effect(environ) if n not in _warned]
    level = environ.get("RINGREDUCE_LOG_LEVEL", "warning").strip().lower()
    if rank != 0 or not names or level == "error":
        return
    _warned.update(names)
    why = "; ".join(f"{n} ({NO_EFFECT[n]})" for n in names)
    print(
        f"[ringreduce WARNING rank 0] Horovod settings without effect in ringreduce: {why}",
        file=sys.stderr,
        flush=True,
    )


def elastic_timeout(given: Optional[float] = None, environ: Mapping[str, str] = os.environ
                    ) -> float:
    """``--elastic-timeout``: ``given``, else ``HOROVOD_ELASTIC_TIMEOUT`` as in horovodrun,
    else 600 seconds."""
    if given is not None:
        return given
    text = environ.get("HOROVOD_ELASTIC_TIMEOUT", "").strip()
    return float(_number(float)("HOROVOD_ELASTIC_TIMEOUT", text)) if text else 600.0
