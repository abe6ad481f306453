"""``horovodrun``'s flags on ``ringrun``: a Horovod launch line runs with the name changed.

``horovodrun`` turns its tuning flags into ``HOROVOD_*`` variables for the ranks
(``--fusion-threshold-mb 32`` is ``HOROVOD_FUSION_THRESHOLD=33554432``); this module does the
same and converts them with the one table in ``_horovod_settings``, so a flag, a YAML
``--config-file`` entry and an exported Horovod variable mean the same thing. Flags for
things ringreduce does not have (NCCL streams, MPI threading) are accepted and
named in one line, as the variables are; flags that would need another launcher
(``--mpi``, ``--mpi-args``, ``--binding-args``, ``--jsrun``) are usage errors that say what
to run instead. Explicit flags beat the config file, as in Horovod.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping
from typing import Any, Optional

from ._horovod_settings import no_effect, translate
from .exceptions import InvalidInputError

__all__ = ["add_arguments", "apply_config_file", "check_build", "rank_env", "refused", "run_env"]

_MB = 1 << 20
# (flag dest, Horovod variable, conversion of the flag's value to the variable's text)
_FLAG_VARS: tuple[tuple[str, str, Any], ...] = (
    ("fusion_threshold_mb", "HOROVOD_FUSION_THRESHOLD", lambda v: int(v * _MB)),
    ("cycle_time_ms", "HOROVOD_CYCLE_TIME", None),
    ("cache_capacity", "HOROVOD_CACHE_CAPACITY", None),
    ("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", int),
    ("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", int),
    ("autotune", "HOROVOD_AUTOTUNE", int),
    ("timeline_filename", "HOROVOD_TIMELINE", None),
    ("timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", int),
    ("stall_check_warning_time_seconds", "HOROVOD_STALL_CHECK_TIME_SECONDS", None),
    ("stall_check_shutdown_time_seconds", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", None),
    ("mpi_threads_disable", "HOROVOD_MPI_THREADS_DISABLE", int),
    ("num_nccl_streams", "HOROVOD_NUM_NCCL_STREAMS", None),
    ("thread_affinity", "HOROVOD_THREAD_AFFINITY", None),
    ("start_timeout", "HOROVOD_START_TIMEOUT", None),
    ("gloo_timeout_seconds", "HOROVOD_GLOO_TIMEOUT_SECONDS", None),
    ("ccl_bgt_affinity", "HOROVOD_CCL_BGT_AFFINITY", None),
    ("log_level", "HOROVOD_LOG_LEVEL", None),
)
# YAML sections of horovodrun's --config-file: (section, key) -> flag dest
_CONFIG_KEYS = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): "hierarchical_allgather",
    ("autotune", "enabled"): "autotune",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "enabled"): "stall_check",
    ("stall_check", "warning_time_seconds"): "stall_check_warning_time_seconds",
    ("stall_check", "shutdown_time_seconds"): "stall_check_shutdown_time_seconds",
    ("library_options", "mpi_threads_disable"): "mpi_threads_disable",
    ("library_options", "num_nccl_streams"): "num_nccl_streams",
    ("library_options", "gloo_timeout_seconds"): "gloo_timeout_seconds",
    ("library_options", "thread_affinity"): "thread_affinity",
    ("logging", "level"): "log_level",
}
_NO_EFFECT_KEYS = {("logging", "with_timestamp"), ("library_options", "ccl_bgt_affinity")}
# --autotune-<name>: (type, Horovod variable), as horovodrun passes them on
_AUTOTUNE_FLAGS: dict[str, tuple[type, str]] = {
    "log_file": (str, "HOROVOD_AUTOTUNE_LOG"),
    "warmup_samples": (int, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
    "steps_per_sample": (int, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
    "bayes_opt_max_samples": (int, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
    "gaussian_process_noise": (float, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags that ringrun did not have yet (all default to None)."""
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="show the frameworks, launchers and transports available, and exit",
    )
    p.add_argument(
        "--config-file",
        help="horovodrun's YAML settings (params, timeline, "
        "stall_check, library_options, logging); flags given win",
    )
    p.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each rank's output "
        "to DIR/rank.<rank>/stdout and stderr (elastic: DIR/worker.<id>/...)",
    )
    p.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        action="store_true",
        dest="prefix_timestamp",
        help="start each output line with the time",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        help="seconds the ranks may take to "
        "connect (RINGREDUCE_CONNECT_TIMEOUT_SECONDS; default 60)",
    )
    p.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="nics",
        action="append",
        help="interface the ranks talk over (RINGREDUCE_IFACE; one)",
    )
    p.add_argument("-i", "--ssh-identity-file", help="ssh's -i (with the default ssh command)")
    p.add_argument("--verbose", action="store_true", help="print where each rank runs")
    p.add_argument("--disable-cache", action="store_true", help="accepted (no check cache)")
    p.add_argument(
        "--tcp",
        action="store_true",
        dest="tcp_flag",
        help="no InfiniBand for NCCL (NCCL_IB_DISABLE=1), as horovodrun",
    )
    p.add_argument(
        "--gloo",
        action="store_true",
        dest="use_gloo",
        help="accepted: ringrun is the launch without MPI",
    )
    for name in ("--mpi", "--jsrun"):
        p.add_argument(name, action="store_true", dest=f"use_{name[2:]}", help=argparse.SUPPRESS)
    for name in ("--mpi-args", "--binding-args"):
        p.add_argument(name, dest=name[2:].replace("-", "_"), help=argparse.SUPPRESS)
    _add_tuning(p.add_argument_group("tuning (horovodrun's; see README, Settings)"))


def _add_tuning(g: Any) -> None:
    flag = argparse.BooleanOptionalAction
    g.add_argument("--fusion-threshold-mb", type=float, help="largest fused allreduce, MiB")
    g.add_argument("--cycle-time-ms", type=float, help="least time between rounds")
    g.add_argument("--cache-capacity", type=int, help="response cache entries")
    g.add_argument(
        "--hierarchical-allreduce",
        action=flag,
        help="shm inside hosts, ring across (default: where it wins)",
    )
    g.add_argument("--hierarchical-allgather", action=flag,
                   help="gather inside hosts, leaders across (default: off)")
    g.add_argument("--autotune", action=flag,
                   help="tune the fusion threshold, cycle time, batching gap and hierarchical "
                   "allreduce while training (README, Autotune)")
    for name, (kind, var) in _AUTOTUNE_FLAGS.items():
        g.add_argument(f"--autotune-{name.replace('_', '-')}", type=kind,
                       help=f"the autotuner's {var}")
    g.add_argument("--timeline-filename", help="rank 0 writes a Chrome trace there")
    g.add_argument("--timeline-mark-cycles", action=flag,
                   help="mark each negotiation round in the timeline (with --timeline-filename)")
    g.add_argument("--stall-check", action=flag, help="--no-stall-check: no stall warnings")
    g.add_argument(
        "--stall-check-warning-time-seconds",
        type=float,
        help="stalled tensors are logged after this long (default 60)",
    )
    g.add_argument(
        "--stall-check-shutdown-time-seconds",
        type=float,
        help="a stall this long fails the job (default off)",
    )
    g.add_argument("--mpi-threads-disable", action=flag, help="no effect")
    g.add_argument("--num-nccl-streams", type=int, help="no effect")
    g.add_argument("--thread-affinity", help="the engine thread's core, one per local rank "
                   "(\"2,3\"; RINGREDUCE_THREAD_AFFINITY)")
    g.add_argument("--ccl-bgt-affinity", type=int, help="no effect")
    g.add_argument("--gloo-timeout-seconds", type=float, help="as --start-timeout")
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"),
    )
    g.add_argument(
        "--log-with-timestamp",
        "--log-without-timestamp",
        "--log-hide-timestamp",
        "--no-log-hide-timestamp",
        action="store_true",
        dest="log_timestamp",
        help=argparse.SUPPRESS,
    )


def refused(a: argparse.Namespace) -> Optional[str]:
    """Why these arguments cannot run under ringrun, or None."""
    if a.use_mpi or a.use_jsrun or a.mpi_args is not None or a.binding_args is not None:
        return (
            "--mpi, --jsrun, --mpi-args and --binding-args need MPI's launcher: run "
            "`mpirun [its options] -np N python train.py` directly (ringreduce picks up "
            "mpirun's ranks), or leave them out for ringrun's own launch"
        )
    if a.ssh_identity_file and a.ssh_command:
        return "give --ssh-identity-file or --ssh-command, not both"
    return None


def apply_config_file(a: argparse.Namespace) -> None:
    """Fill the flags not given on the command line from ``a.config_file`` (YAML), each
    value converted as its flag's would be."""
    try:
        import yaml
    except ImportError:
        raise InvalidInputError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        with open(a.config_file) as f:
            config = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise InvalidInputError(f"{a.config_file}: not YAML: {err}") from None
    if not isinstance(config, Mapping):
        raise InvalidInputError(f"{a.config_file}: expected a mapping of sections")
    controller = str(config.get("controller") or "gloo").lower()
    if controller not in ("gloo", "mpi"):
        raise InvalidInputError(f"{a.config_file}: no such controller {controller!r}")
    a.use_mpi = a.use_mpi or (controller == "mpi" and not a.use_gloo)
    actions = _actions()
    for section, values in config.items():
        if section == "controller" or values is None:  # a section left empty
            continue
        if not isinstance(values, Mapping):
            raise InvalidInputError(f"{a.config_file}: section {section!r} is not a mapping")
        for key, value in values.items():
            dest = _CONFIG_KEYS.get((section, key))
            if dest is None and section == "autotune" and key in _AUTOTUNE_FLAGS:
                dest = f"autotune_{key}"
            if dest is None and (section, key) not in _NO_EFFECT_KEYS:
                raise InvalidInputError(f"{a.config_file}: unknown setting {section}.{key}")
            if dest is not None and value is not None and getattr(a, dest) is None:
                setattr(a, dest, _converted(actions[dest], value,
                                            f"{a.config_file}: {section}.{key}"))


def _actions() -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return {act.dest: act for act in p._actions}


def _converted(action: argparse.Action, value: Any, where: str) -> Any:
    """A config file's ``value`` as the flag's own parsing would give it."""
    if isinstance(action, argparse.BooleanOptionalAction):
        text = str(value).strip().lower()
        if text not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise InvalidInputError(f"{where}={value!r}: expected true or false")
        return text in ("true", "1", "yes", "on")
    try:
        out = action.type(value) if action.type else value
    except (TypeError, ValueError):
        raise InvalidInputError(f"{where}={value!r}: expected a "
                                f"{getattr(action.type, '__name__', 'value')}") from None
    if action.choices is not None and out not in action.choices:
        raise InvalidInputError(f"{where}={value!r}: expected one of {', '.join(action.choices)}")
    return out


def _horovod_vars(a: argparse.Namespace) -> dict[str, str]:
    """The ``HOROVOD_*`` variables horovodrun would give the ranks for these flags."""
    out = {}
    for dest, var, conv in _FLAG_VARS:
        value = getattr(a, dest)
        if value is not None and not (dest == "timeline_mark_cycles" and not a.timeline_filename):
            out[var] = str(conv(value) if conv else value)
    if a.stall_check is False:
        out["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    for name, (_, var) in _AUTOTUNE_FLAGS.items():
        if getattr(a, f"autotune_{name}") is not None:
            out[var] = str(getattr(a, f"autotune_{name}"))
    return out


def rank_env(a: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """Variables for every rank from the Horovod flags, and the flags without effect.

    Returns
    -------
    (dict, list)
        ``RINGREDUCE_*`` (and ``NCCL_IB_DISABLE`` for ``--tcp``) values, and the names
        of the flags that change nothing in ringreduce, for one line from ringrun.
    """
    horovod = _horovod_vars(a)
    env = {k: v for k, v in translate(horovod).items() if v}
    nics = [n for given in a.nics or [] for n in str(given).split(",") if n.strip()]
    if len(nics) > 1:
        raise InvalidInputError(f"network interfaces {', '.join(nics)}: ringreduce talks "
                                "over one interface; name one")
    if nics:
        env["RINGREDUCE_IFACE"] = nics[0].strip()
    if a.tcp_flag:
        env["NCCL_IB_DISABLE"] = "1"
    useless = sorted("--" + v[len("HOROVOD_"):].lower().replace("_", "-")
                     for v in no_effect(horovod))
    return env, useless


def check_build() -> str:
    """horovodrun --check-build's table, for this installation."""
    from . import __version__, cuda_built, nccl_built

    def row(ok: bool, name: str) -> str:
        return f"    [{'X' if ok else ' '}] {name}"

    def has(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    lines = [
        f"ringreduce v{__version__}:",
        "",
        "Available Frameworks:",
        row(has("torch"), "PyTorch"),
        row(has("tensorflow"), "TensorFlow"),
        row(has("keras"), "Keras"),
        row(has("jax"), "JAX"),
        "",
        "Available Launchers:",
        row(True, "ringrun (and torchrun-style variables)"),
        row(has("mpi4py"), "MPI (mpirun, srun: through mpi4py)"),
        "",
        "Available Tensor Operations:",
        row(True, "shared memory (within a host)"),
        row(True, "TCP (across hosts)"),
        row(cuda_built(), "CUDA"),
        row(nccl_built(), "NCCL"),
    ]
    return "\n".join(lines)


def run_env(start_timeout: Optional[float], network_interface: Optional[str]) -> dict[str, str]:
    """``horovod.run``'s ``start_timeout`` and ``network_interface`` as every rank's
    variables, the same as ``--start-timeout`` and ``--network-interfaces`` give."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    a.start_timeout, a.nics = start_timeout, network_interface and [network_interface]
    return rank_env(a)[0]
