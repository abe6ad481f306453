"""Process sets in real processes: static sets at init, a dynamic one, numpy and torch.

    RANK=r WORLD_SIZE=n ... python process_sets_worker.py

Sets: ``tail`` = every rank but 0, ``solo`` = rank 0 alone (static, at init); then dynamic
``pair`` = ranks 0 and n-1 (added and removed at run time; on it, calls refused by one
member and join(process_set=)); under mpirun, then a fresh init with Horovod's sets from MPI
communicators (each rank its half of ``COMM_WORLD.Split``). Each check raises on failure;
at the end every rank logs ``OK rank <r>``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from workerlib import run, say, set_rank, watch_job

import ringreduce.torch as rr


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {rr.rank()}: {what}")


def torch_on_set(ps: rr.ProcessSet) -> None:
    """Every torch entry point with process_set=, among the set's members."""
    r, members = rr.rank(), ps.ranks
    got = rr.allreduce(torch.full((4,), float(r)), op=rr.Sum, process_set=ps)
    check(torch.equal(got, torch.full((4,), float(sum(members)))), f"allreduce on {ps}")
    g = rr.allgather(torch.tensor([r]), process_set=ps)
    check(g.tolist() == members, f"allgather on {ps}: {g.tolist()}")
    b = rr.broadcast(torch.tensor([r]), root_rank=ps.size() - 1, process_set=ps)
    check(b.item() == members[-1], f"broadcast on {ps}")
    check(rr.broadcast_object({"r": r}, root_rank=0, process_set=ps) == {"r": members[0]},
          f"broadcast_object on {ps}")
    check(rr.allgather_object(r, process_set=ps) == members, f"allgather_object on {ps}")
    rr.barrier(process_set=ps)
    torch.manual_seed(r)  # different weights until the broadcast
    model = torch.nn.Linear(3, 2)
    opt = rr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), process_set=ps)
    rr.broadcast_parameters(model.state_dict(), root_rank=0, process_set=ps)
    rr.broadcast_optimizer_state(opt, root_rank=0, process_set=ps)
    opt.zero_grad()
    model(torch.full((1, 3), float(r + 1))).sum().backward()
    opt.step()
    w = rr.allgather(model.weight.detach()[None], process_set=ps)
    check(all(torch.equal(w[0], w[i]) for i in range(ps.size())), f"optimizer on {ps}")


def refusals_on_set(ps: rr.ProcessSet) -> None:
    """A call the set's last member refuses locally (a bad root_rank), named and unnamed:
    the other members raise at once, naming that rank and its error, and the set goes on."""
    import ringreduce

    last = ps.ranks[-1]
    for name in ("refused", None):
        root = 7 if rr.rank() == last else 0
        try:
            ringreduce.broadcast(np.ones(2), root_rank=root, name=name, process_set=ps)
        except rr.InvalidInputError as err:
            check(rr.rank() == last and "root_rank" in str(err), str(err))
        except rr.MismatchError as err:
            check(f"rank {last}" in str(err) and "refused this call locally" in str(err)
                  and "root_rank must be" in str(err), str(err))
        else:
            raise AssertionError(f"broadcast {name!r} refused by rank {last} completed")
    s = ringreduce.allreduce(np.ones(2), op=rr.Sum, process_set=ps)
    check(s.tolist() == [ps.size()] * 2, f"allreduce on {ps} after refusals")


def join_on_set(ps: rr.ProcessSet) -> None:
    """torch's join(process_set=): the set's first member joins at once, the last runs one
    more allreduce (the joined one contributes zeros), then joins; both get the global rank
    of the last."""
    last = ps.ranks[-1]
    if rr.rank() == last:
        s = rr.allreduce(torch.ones(2), op=rr.Sum, process_set=ps)
        check(s.tolist() == [1.0, 1.0], f"allreduce on {ps} with a joined member: {s}")
    got = rr.join(process_set=ps)
    check(got == last, f"join(process_set={ps}) returned {got}, not {last}")


def main() -> None:
    watch_job()
    size = int(os.environ.get("WORLD_SIZE") or os.environ["PMI_SIZE"])  # env launch / MPICH
    tail, solo = rr.ProcessSet(range(1, size)), rr.ProcessSet([0])
    rr.init(process_sets=[tail, solo])
    set_rank(rr.rank())
    n, r = rr.size(), rr.rank()
    check((tail.process_set_id, solo.process_set_id) == (1, 2), "static ids")
    for ps in (tail, solo):
        if ps.included():
            torch_on_set(ps)
        else:
            try:
                rr.allreduce(torch.ones(1), process_set=ps)
            except rr.InvalidInputError as err:
                check(f"rank {r} is not a member" in str(err), str(err))
            else:
                raise AssertionError("a non-member's call was not refused")
    try:
        rr.add_process_set([0, n - 1])
    except rr.InvalidInputError:
        pass
    else:
        raise AssertionError("add_process_set without dynamic sets was accepted")
    rr.global_process_set  # noqa: B018 (the global set needs no registration)
    x = np.full(3, r, np.int64)
    import ringreduce

    ringreduce._comm().process_sets.dynamic = True  # as init(process_sets="dynamic") would
    pair = rr.add_process_set([0, n - 1])
    if pair.included():
        s = ringreduce.allreduce(x, op=rr.Sum, process_set=pair)
        check(s.tolist() == [n - 1] * 3, f"numpy allreduce on {pair}")
        refusals_on_set(pair)
        join_on_set(pair)
    check(rr.remove_process_set(pair), "remove_process_set")
    check(rr.allreduce(torch.ones(1), op=rr.Sum).item() == n, "global after the sets")
    rr.shutdown()
    if "PMI_SIZE" in os.environ:  # under mpirun: Horovod's sets from MPI communicators
        sets_from_mpi_comms(r, n)
    say(f"OK rank {r}")


def sets_from_mpi_comms(r: int, n: int) -> None:
    """Each rank passes its own half of COMM_WORLD.Split; every rank registers both."""
    from mpi4py import MPI

    half = rr.ProcessSet(MPI.COMM_WORLD.Split(color=r % 2, key=r))
    rr.init(process_sets=[half])
    check(half.ranks == list(range(r % 2, n, 2)), f"ranks from the communicator: {half}")
    check(half.process_set_id == 1 + r % 2, f"ids in order of the lowest member: {half}")
    got = rr.allreduce(torch.ones(1), op=rr.Sum, process_set=half).item()
    check(got == len(half.ranks), f"allreduce on {half}: {got}")
    # Leaving is not collective (as in Horovod): a rank whose set finished first
    # must not shut down under the other set's call.
    rr.barrier()
    rr.shutdown()


if __name__ == "__main__":
    run(main)
