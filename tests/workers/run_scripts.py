"""Run several scripts one after another in this process, each as ``python SCRIPT ARGS``
would run it: as ``__main__``, with its own ``sys.argv``, ``sys.path[0]`` (the script's
directory) and working directory.

    mpirun -np 2 python run_scripts.py SPEC.json

TensorFlow costs ~10 CPU-seconds to import in every process, so the example tests
launch one job for all their scripts instead of one job per script. ``SPEC.json`` is a
list of ``{"script": path, "args": [...], "cwd": dir, "out": prefix}``, run in order.
Rank r writes each script's ``sys.stdout`` and ``sys.stderr`` to ``<prefix>.<r>.out``
and ``.err``, and rank 0 the SHA-256 of each file in ``cwd`` afterwards to
``<prefix>.files`` (a JSON object by name). A script that raises (or exits non-zero) ends the
run: its traceback in its ``.err``, exit status 1; so does one with ``"fails": true`` that
does not fail (its failure is expected, and the run goes on). Scripts that leave eager execution
(TF1 graphs) must come last; each starts with an empty default TensorFlow graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import runpy
import sys
import traceback

from workerlib import launch_rank


def run_one(spec: dict, rank: int) -> bool:
    """Run one script of the spec; whether it ended as expected."""
    prefix, here = spec["out"], os.getcwd()
    if "tensorflow" in sys.modules:  # an empty default graph, as a fresh process has
        sys.modules["tensorflow"].compat.v1.reset_default_graph()
    with open(f"{prefix}.{rank}.out", "w") as out, open(f"{prefix}.{rank}.err", "w") as err, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv = [spec["script"]] + [str(a) for a in spec["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(spec["script"]))  # as python SCRIPT
        os.chdir(spec["cwd"])
        try:
            runpy.run_path(spec["script"], run_name="__main__")
            ok = True
        except SystemExit as exit_:
            ok = exit_.code in (None, 0)
            if not ok:
                print(f"exit status {exit_.code}", file=err)
        except BaseException:
            traceback.print_exc(file=err)
            ok = False
        finally:
            os.chdir(here)
    if rank == 0:
        with open(f"{prefix}.files", "w") as f:
            json.dump(digests(spec["cwd"]), f)
    return ok != spec.get("fails", False)


def digests(directory: str) -> dict:
    """Each file's SHA-256 by name (a directory's: None)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            out[name] = None
        else:
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        specs = json.load(f)
    rank = launch_rank()
    for spec in specs:
        print(f"rank {rank}: running {spec['script']} {spec['args']}", flush=True)
        if not run_one(spec, rank):
            print(f"rank {rank}: {spec['script']} failed: see {spec['out']}.{rank}.err",
                  file=sys.stderr, flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
