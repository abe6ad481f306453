"""ringreduce.ray.RayExecutor on a real Ray (a private local cluster, ray from PyPI): one
driver process (tests/workers/ray_driver.py) starts Ray once and runs every case in order,
printing a line per case that one test here reads. The driver runs under tests/procs.py,
which kills it, Ray's own processes and the actors at the timeout or after. What needs no
cluster (argument checks, the GPU layout, the driver-side helpers) runs in this process."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from procs import PYTHON, WORKERS, base_env, run_procs

pytest.importorskip("ray", reason="ray is not installed (pip install 'ringreduce[ray]')")

from ringreduce import _task_world as tw  # noqa: E402
from ringreduce.exceptions import InvalidInputError  # noqa: E402
from ringreduce.ray import ElasticRayExecutor, RayExecutor, RaySettings  # noqa: E402
from ringreduce.ray import _death as death_text  # noqa: E402
from ringreduce.ray._placement import visible_devices  # noqa: E402

pytestmark = pytest.mark.timeout(240)

DRIVER_TIMEOUT = 180  # seconds; the whole driver takes ~20 s on 2 cores


# ------------------------------------------------------------- the Ray driver
@pytest.fixture(scope="module")
def driver():
    return _run_driver("ray_driver.py", "no_room")


@pytest.fixture(scope="module")
def elastic():
    """The elastic cases (tests/workers/ray_elastic_driver.py), on a cluster of 2 nodes."""
    return _run_driver("ray_elastic_driver.py", "own_discovery")


def _run_driver(script: str, last_case: str, timeout: float = DRIVER_TIMEOUT) -> dict:
    """Run one Ray driver script to its end; its cases' lines by name, and what outlived it."""
    ray_tmp = tempfile.mkdtemp(prefix="rr-ray-", dir="/tmp")  # short: Ray's sockets go there
    log_dir = Path(ray_tmp) / "logs"
    log_dir.mkdir()
    try:
        env = {"RR_RAY_TMP": ray_tmp, "RR_MARKS": str(Path(ray_tmp) / "marks"),
               "RAY_USAGE_STATS_ENABLED": "0"}
        job = run_procs([("ray driver", [PYTHON, str(WORKERS / script)],
                          base_env(env, log_dir))], timeout, log_dir)
        leftovers = _processes_mentioning(ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    proc = job.procs[0]
    assert not job.timed_out, f"the Ray driver hit its timeout\n{job.describe()}"
    # a case's line may follow, on the same line, what Ray's own threads printed without a
    # newline (a worker's death, as the 'dying' case provokes)
    lines = [json.loads(s[s.index('{"case"'):]) for s in proc.stdout.splitlines()
             if '{"case"' in s]
    cases = {line["case"]: line for line in lines}
    assert proc.returncode == 0 and last_case in cases, job.describe()
    return {"cases": cases, "survivors": job.survivors, "leftovers": leftovers}


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name ``text`` (this cluster's directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


def ok(driver, name: str):
    """The value of case ``name``, which must not have failed."""
    line = driver["cases"][name]
    assert "error" not in line, line.get("traceback", line)
    return line["value"]


def failed(driver, name: str) -> dict:
    line = driver["cases"][name]
    assert "error" in line, f"case {name} did not fail: {line}"
    return line


# ---------------------------------------------------------------- with Ray
def test_run_gives_ranks_and_allreduce(driver):
    got = ok(driver, "run_twice")
    first, second = got["first"], got["second"]
    assert [r["rank"] for r in first] == [0, 1]
    assert {r["size"] for r in first} == {2} and [r["local"] for r in first] == [[0, 2], [1, 2]]
    # mean of rank * scale: (0 + 1) / 2 * 2.0, then * 4.0
    assert [r["avg"] for r in first] == [[1.0] * 4] * 2
    assert [r["avg"] for r in second] == [[2.0] * 4] * 2
    assert len({r["pid"] for r in first}) == 2


def test_second_run_reuses_the_world(driver):
    got = ok(driver, "run_twice")
    assert [r["was_in"] for r in got["first"]] == [False, False]
    assert [r["was_in"] for r in got["second"]] == [True, True]  # init() stayed done
    assert [r["pid"] for r in got["first"]] == [r["pid"] for r in got["second"]]
    assert len({r["port"] for r in got["first"] + got["second"]}) == 1


def test_actor_environment(driver):
    env = ok(driver, "environment")
    assert [e["RANK"] for e in env] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in env} == {"2"}
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"}
    assert len({e["MASTER_ADDR"] for e in env}) == 1
    # create_settings(timeout_s=20), extra_env_vars, the driver's HOROVOD_* variable
    assert {e["RINGREDUCE_CONNECT_TIMEOUT_SECONDS"] for e in env} == {"20.0"}
    assert {e["RR_RAY_MARK"] for e in env} == {"7"}
    assert {e["HOROVOD_FUSION_THRESHOLD"] for e in env} == {"1048576"}


def test_torch_distributed_optimizer_step(driver):
    # gradients [1, 0] and [2, 0] average to [1.5, 0]: weight 1 - 0.1 * 1.5 on both ranks
    weights = ok(driver, "torch_step")
    assert len(weights) == 2 and weights[0] == weights[1]
    assert weights[0] == pytest.approx([0.85, 1.0])


def test_execute_execute_single_and_run_remote(driver):
    got = ok(driver, "executable")
    assert got["execute"] == [15, 15]  # Counter(10, step=5).bump() on each rank
    assert got["single"] == 20         # rank 0's counter only
    assert got["remote"] == [0, 1] and got["refs_are_refs"]


def test_rank_error_comes_back_promptly(driver):
    line = failed(driver, "failing")
    assert line["error"] == "ValueError" and line["message"] == "rank 1 found a bad shard"
    assert "RayExecutor.run: rank 1 raised" in line["cause"]
    assert "raise_on_rank_1" in line["cause"]
    assert line["seconds"] < 10  # rank 0 sat in an allreduce: no waiting for it


def test_executor_usable_after_an_error(driver):
    before = ok(driver, "run_twice")["first"]
    after = ok(driver, "after_failure")
    assert [r["rank"] for r in after] == [0, 1] and [r["avg"] for r in after] == [[0.5] * 4] * 2
    assert [r["was_in"] for r in after] == [False, False]  # a new world...
    assert after[0]["port"] != before[0]["port"]           # ...at a new rendezvous
    assert [r["pid"] for r in after] == [r["pid"] for r in before]  # in the same actors


def test_dead_worker_is_reported_by_rank(driver):
    line = failed(driver, "dying")
    assert line["error"] == "RingReduceError"
    assert "RayExecutor.run: rank 1's worker ended without a result" in line["message"]
    assert line["seconds"] < 20


def test_dead_worker_is_replaced(driver):
    got = ok(driver, "after_death")
    assert [r["avg"] for r in got["run"]] == [[0.5] * 4] * 2
    pids = [r["pid"] for r in got["run"]]
    assert pids[0] == got["old_pids"][0] and pids[1] != got["old_pids"][1]
    # the replacement built a new executable: Counter(10); rank 0's kept its count
    assert got["counters"] == [20, 10]


def test_run_remote_errors_then_recovery(driver):
    got = ok(driver, "remote_failure")
    first, second = got["errors"]
    # Ray's RayTaskError(ValueError): a ValueError, with the rank's own traceback in its text
    assert second["is_value_error"] and "in raise_on_rank_1" in second["message"]
    assert "PeerLostError" in first["error"]
    assert got["after"] == [0, 1]


def test_shutdown_kills_the_actors(driver):
    got = ok(driver, "shutdown")
    assert got["alive"] == []
    assert "not started" in got["run_after"]


def test_hosts_layout(driver):
    got = ok(driver, "hosts")
    assert [r["rank"] for r in got["run"]] == [0, 1]
    assert [r["local"] for r in got["run"]] == [[0, 2], [1, 2]]
    assert "started already; call shutdown()" in got["start_again"]


def test_executable_cls_error_fails_start(driver):
    got = ok(driver, "bad_executable")  # start() raised; the case reports it
    assert got["error"] == "KeyError" and "RayExecutor.start: rank 1 raised" in got["cause"]
    assert driver["cases"]["bad_executable"]["seconds"] < 10  # rank 0 did not sit out 60 s
    assert "not started" in got["run_after"]  # start() shut the executor down again


def test_placement_timeout(driver):
    got = ok(driver, "no_room")  # start() raised; the case reports it and what was left
    assert got["error"] == "RingReduceTimeoutError"
    assert "could not reserve 8 bundle(s)" in got["message"]
    assert driver["cases"]["no_room"]["seconds"] < 10
    assert got["pending_groups"] == []  # the placement group was removed


def test_no_ray_process_outlives_the_driver(driver):
    assert driver["leftovers"] == []
    assert driver["survivors"] == []


# ------------------------------------------------------------ elastic on Ray
def _sizes(values) -> list:
    """The world size of each epoch, the same on every rank of the last generation."""
    assert [v["rank"] for v in values] == list(range(len(values)))
    assert len({str(v["sizes"]) for v in values}) == 1 and len({v["total"] for v in values}) == 1
    return values[0]["sizes"]


def test_elastic_grows_when_a_node_joins(elastic):
    values = ok(elastic, "node_joins")  # the head's 2 slots, then a node of 2 joins
    sizes = _sizes(values)
    assert len(values) == 4 and sizes[0] == 2 and sizes[-5:] == [4] * 5
    assert sizes == sorted(sizes)  # 2, 2, ..., 4: no epoch lost or run twice
    assert values[0]["total"] == sum(sizes)  # each epoch's allreduce summed its world


def test_elastic_min_workers_executor_takes_every_slot(elastic):
    values = ok(elastic, "min_workers_executor")  # RayExecutor(min_workers=2, max_workers=8)
    assert _sizes(values) == [4, 4, 4] and values[0]["total"] == 12


def test_elastic_crashed_worker_blacklists_its_node_and_rolls_back(elastic):
    values = ok(elastic, "worker_dies")  # the last rank exits at epoch 3 of the 4-rank world
    sizes = _sizes(values)
    assert len(values) == 2 and sizes == [4, 4, 4] + [2] * 7
    assert values[0]["total"] == sum(sizes)  # the broken epoch was rolled back, not counted


def test_elastic_node_removed_during_training(elastic):
    values = ok(elastic, "node_leaves")  # the second node is removed after epoch 3 at 4 ranks
    sizes = _sizes(values)
    assert len(values) == 2 and sizes[:3] == [4, 4, 4] and sizes[-5:] == [2] * 5
    assert values[0]["total"] == sum(sizes)


def test_elastic_error_everywhere_is_raised(elastic):
    got = ok(elastic, "fails_everywhere")
    assert got["error"] == "ValueError" and got["message"].startswith("bad batch on rank ")
    assert "ElasticRayExecutor.run: rank " in got["cause"]


def test_elastic_with_horovods_discovery_object(elastic):
    values = ok(elastic, "own_discovery")  # find_available_hosts_and_slots(): {head IP: 2}
    assert _sizes(values) == [2, 2, 2]


def test_no_ray_process_outlives_the_elastic_driver(elastic):
    assert elastic["leftovers"] == []
    assert elastic["survivors"] == []


# ------------------------------------------------------------ Ray Train
@pytest.fixture(scope="module")
def train():
    """The Ray Train cases (tests/workers/ray_train_driver.py): RingreduceTrainer; ~75 s
    on 2 cores (Ray Train starts a controller and a worker group per fit)."""
    return _run_driver("ray_train_driver.py", "refusals", timeout=220)


REFERENCE_STEPS = 8  # the driver's full-batch gradient descent (its ``reference()``)


def test_ray_train_trains_as_one_process_would(train):
    got = ok(train, "trains")
    assert got["error"] is None
    ranks = got["ranks"]
    assert [(r["rank"], r["world_rank"], r["local"], r["size"]) for r in ranks] == \
        [(0, 0, [0, 2], 2), (1, 1, [1, 2], 2)]
    # averaged equal shards are the full batch: the reference, on both ranks and stored
    for weights in (ranks[0]["weights"], ranks[1]["weights"], got["stored"]["weights"]):
        assert weights == pytest.approx(got["reference"], rel=1e-12)
    assert got["stored"]["step"] == REFERENCE_STEPS - 1


def test_ray_train_config_and_driver_settings_reach_the_workers(train):
    envs = [r["env"] for r in ok(train, "trains")["ranks"]]
    # HorovodConfig(timeout_s=20, env=...), and the driver's HOROVOD_* variable
    assert envs == [{"RINGREDUCE_CONNECT_TIMEOUT_SECONDS": "20.0",
                     "HOROVOD_FUSION_THRESHOLD": "1048576", "RR_MARK": "7"}] * 2


def test_ray_train_dataset_shards_cover_the_rows_once(train):
    shards = [r["shards"] for r in ok(train, "trains")["ranks"]]
    assert all(s["mine"] > 0 for s in shards)
    assert sum(s["mine"] for s in shards) == sum(range(64))
    assert [s["total"] for s in shards] == [sum(range(64))] * 2


def test_ray_train_restarts_from_its_checkpoint_after_a_rank_dies(train):
    got = ok(train, "recovers")
    assert got["error"] is None
    first = [r for r in got["ranks"] if r["start"] == 0]
    again = [r for r in got["ranks"] if r["start"] > 0]
    # rank 1 exited at step 4: rank 0's allreduce named it, within seconds
    assert [r["rank"] for r in first] == [0]
    assert first[0]["error"] == "PeerLostError"
    assert "rank 1" in first[0]["message"] and "exited" in first[0]["message"]
    # Ray Train started a new group, which resumed from a checkpoint of the first one
    assert [r["rank"] for r in again] == [0, 1]
    assert len({r["start"] for r in again}) == 1 and again[0]["start"] <= 4
    assert {r["pid"] for r in again}.isdisjoint({first[0]["pid"]})
    for weights in (again[0]["weights"], again[1]["weights"], got["stored"]["weights"]):
        assert weights == pytest.approx(got["reference"], rel=1e-12)


def test_ray_train_a_raising_rank_is_named_on_the_others(train):
    got = ok(train, "raises")
    ranks = {r["rank"]: r for r in got["ranks"]}
    assert ranks[1]["error"] == "ValueError"
    # rank 1 left the world as its function raised: rank 0's wait ended naming it
    assert ranks[0]["error"] == "PeerLostError", ranks
    assert "rank 1 on host" in ranks[0]["message"] and "shut down" in ranks[0]["message"]
    assert got["fit"] == "WorkerGroupError" and got["names_value_error"], got


def test_ray_train_a_frozen_rank_does_not_hang_the_fit(train):
    # rank 0 stopped (SIGSTOP), rank 1 raised: leaving the world gives up on rank 0
    # after on_shutdown's 5 s; Ray Train then stops the group and fit raises
    got = ok(train, "frozen")
    assert got["fit"] == "WorkerGroupError" and got["seconds"] < 60, got


def test_ray_train_arguments_refused(train):
    got = ok(train, "refusals")
    assert "RingreduceConfig: nics=" in got["two_nics"] and "one interface" in got["two_nics"]
    assert got["one_nic"] == "lo"
    assert got["both"] == "RingreduceTrainer: give ringreduce_config or horovod_config, not both"
    assert "got BackendConfig" in got["foreign"] and "HorovodConfig" in got["foreign"]


def test_ray_train_example_trains(train):
    """examples/ray_train.py: HorovodTrainer on the digits, 4 epochs."""
    assert ok(train, "example")["accuracy"] > 0.9


def test_no_ray_process_outlives_the_train_driver(train):
    assert train["survivors"] == [] and train["leftovers"] == []


# -------------------------------------------------------------- without Ray
@pytest.mark.parametrize("kwargs, needle", [
    ({}, "say how many ranks"),
    ({"num_workers": 2, "num_hosts": 1}, "not both"),
    ({"num_workers": 0}, "num_workers=0"),
    ({"num_hosts": 2, "num_workers_per_host": 0}, "num_workers_per_host=0"),
    ({"num_workers": 2, "min_workers": 1}, "fixed-size job, or min_workers"),
    ({"num_workers": 2, "reset_limit": 3}, "reset_limit only mean something to an elastic"),
    ({"min_workers": 0}, "min_workers=0"),
    ({"min_workers": 3, "max_workers": 2}, "max_workers=2: need a whole number >= min_work"),
    ({"min_workers": 1, "cooldown_range": (5, 1)}, "cooldown range"),
    ({"num_workers": 1, "gpus_per_worker": 1}, "use_gpu=True"),
    ({"num_workers": 1, "cpus_per_worker": 0}, "reserve some CPUs"),
])
def test_executor_arguments_refused(kwargs, needle):
    with pytest.raises(InvalidInputError, match=needle):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def test_calls_before_start_and_callbacks_refused():
    ex = RayExecutor(None, num_workers=2, elastic_timeout=5, override_discovery=False)
    for call in (lambda: ex.run(print), lambda: ex.execute(print),
                 lambda: ex.execute_single(print), lambda: ex.run_remote(print)):
        with pytest.raises(InvalidInputError, match="not started; call start"):
            call()
    with pytest.raises(InvalidInputError, match="callbacks are not supported"):
        ex.run(print, callbacks=[print])
    ex.shutdown()  # harmless when not started


def test_elastic_executor_without_ray():
    ex = RayExecutor(None, min_workers=2, max_workers=4, cpus_per_worker=2, reset_limit=3)
    with pytest.raises(InvalidInputError, match="not started; call start"):
        ex.run(print)
    for call in (lambda: ex.execute(print), lambda: ex.execute_single(print),
                 lambda: ex.run_remote(print)):
        with pytest.raises(InvalidInputError, match="not supported by an elastic executor"):
            call()
    with pytest.raises(InvalidInputError, match="executable_cls is not supported"):
        ex.start(executable_cls=dict)
    ex.shutdown()  # harmless
    s = ElasticRayExecutor.create_settings(min_np=2, max_np=6, elastic_timeout=9, nics="lo")
    assert (s.min_num_proc, s.max_num_proc, s.elastic_timeout, s.nics) == (2, 6, 9, "lo")
    with pytest.raises(InvalidInputError, match="gpus_per_slot|use_gpu=True"):
        ElasticRayExecutor(s, gpus_per_slot=1)
    with pytest.raises(InvalidInputError, match="override_discovery=False needs"):
        ElasticRayExecutor(s, override_discovery=False)
    with pytest.raises(InvalidInputError, match="callbacks are not supported"):
        ElasticRayExecutor(s).run(print, callbacks=[print])
    with pytest.raises(InvalidInputError, match="not started"):
        ElasticRayExecutor(s).run(print)


def test_create_settings(tmp_path):
    key = tmp_path / "id"
    s = RayExecutor.create_settings(timeout_s=5, ssh_identity_file=str(key), ssh_str="KEY",
                                    placement_group_timeout_s=7, nics={"eth0"})
    assert s == RaySettings(timeout_s=5, placement_group_timeout_s=7, nics={"eth0"},
                            ssh_identity_file=str(key))
    assert not key.exists()  # no ssh under Ray: the key is not written
    with pytest.raises(InvalidInputError, match="create_settings: nics=.*one interface"):
        RayExecutor.create_settings(nics=["eth0", "eth1"])


def test_gpu_devices_per_host_in_rank_order():
    ws = [tw.Worker(h, "a", 1) for h in "abab"]
    got = visible_devices(ws, [["3"], ["0"], ["1"], []])
    assert got == ["3,1", "0", "3,1", "0"]
    assert visible_devices(ws[:2], [[], []]) == [None, None]


def test_death_text():
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n"
            "\tpid: 77\n\tip: 10.0.0.1\nThe actor is dead because its worker process died.")
    assert death_text(RuntimeError(text)) == ("The actor died unexpectedly before finishing "
                                              "this task. (pid: 77, ip: 10.0.0.1)")
