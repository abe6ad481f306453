"""Elastic numpy worker for tests/test_elastic.py: ``elastic_worker.py STEPS [ACTION...]``.

Each step allreduces (Sum) a vector of ones and appends its first element, the job's size,
to ``state.sizes``; it commits every 5 steps (see ``every``). So the final list says which sizes ran
which steps, and that steps after a failure restarted from the last commit. Actions:

* ``die:W:S``: worker W exits with code 3 right after step S (before its commit);
* ``freeze:W:S``: worker W stops itself (SIGSTOP) right after step S;
* ``grow:FILE:S``: rank 0 appends ``c:1`` to the discovery FILE after step S;
* ``shrink:FILE:S``: rank 0 rewrites FILE without host ``c`` after step S;
* ``progress:FILE``: rank 0 writes the step it finished to FILE after every step;
* ``every:N``: commit every N steps instead of 5; ``sleep:S``: S seconds per step;
* ``until-size:N``: go on past STEPS (committing as usual) until the last commit period
  of steps ran on N ranks;
* ``late:S``: sleep S seconds before ``init()``;
* ``rendezvous-death:W``: worker W exits (code 3) after the driver gave it a rank, before
  it sends its endpoint record (the others' rendezvous breaks up);
* ``crash``: raise at once, before init (every worker fails).

Prints ``RESULT <worker> rank <r> size <n> sizes <3x10,2x50> resets <k>`` at the end
(``resets``: how many times this worker was reset).
"""

import os
import signal
import sys
import time

import numpy as np

import ringreduce as rr
import ringreduce.elastic as el

steps = int(sys.argv[1])
actions = [a.split(":") for a in sys.argv[2:]]
options = {a[0]: float(a[1]) for a in actions if a[0] in ("every", "sleep", "until-size")}
every, pause = int(options.get("every", 5)), options.get("sleep", 0.01)
min_size = int(options.get("until-size", 0))
me = os.environ["RINGREDUCE_ELASTIC_WORKER"]
if ["crash"] in actions:
    raise SystemExit("crash requested")

for a in actions:
    if a[0] == "late":
        time.sleep(float(a[1]))
    if a[0] == "rendezvous-death" and a[1] == me:
        el._client.join()
        os._exit(3)
rr.init()
state = el.ObjectState(step=0, sizes=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(rr.size())])


def act(step: int) -> None:
    for a in actions:
        if a[0] == "progress" and rr.rank() == 0:
            with open(a[1], "w") as f:
                f.write(str(step))
        if a[0] == "die" and a[1] == me and int(a[2]) == step:
            os._exit(3)
        if a[0] == "freeze" and a[1] == me and int(a[2]) == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if a[0] == "grow" and rr.rank() == 0 and int(a[2]) == step:
            with open(a[1], "a") as f:
                f.write("c:1\n")
        if a[0] == "shrink" and rr.rank() == 0 and int(a[2]) == step:
            with open(a[1]) as f:
                kept = [line for line in f if not line.startswith("c")]
            with open(a[1], "w") as f:
                f.writelines(kept)


@el.run
def train(state: el.ObjectState) -> str:
    while state.step < steps or (min_size and state.sizes[-every:] != [min_size] * every):
        x = rr.allreduce(np.ones(8, np.float32), op=rr.Sum, name="x")
        assert (x == rr.size()).all(), (x, rr.size())
        state.sizes.append(int(x[0]))
        state.step += 1
        act(state.step)
        if state.step % every == 0:
            state.commit()
        time.sleep(pause)
    runs = []
    for n in state.sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}x{k}" for n, k in runs)


sizes = train(state)
print(f"RESULT {me} rank {rr.rank()} size {rr.size()} sizes {sizes} resets {len(resets)}",
      flush=True)
rr.shutdown()
