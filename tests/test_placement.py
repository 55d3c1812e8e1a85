"""Which devices each process owns, on simulated machines: the rule (common.placement), the variables
compare.py's launcher starts every worker with, and hand launches (torchrun, CUDA_VISIBLE_DEVICES,
ROSETTA_LOCAL_*) on one machine or several, for every framework. No GPU needed: a machine is a list of
GPU ids, and a worker sees the ones its CUDA_VISIBLE_DEVICES names, else all of them."""
import json

import pytest

from common import FRAMEWORKS, RosettaError
from harness.processes.cluster import engine_env
from common.placement import (HIDE, HIDES_GPUS, LAUNCHER_VARS, OURS, local_devices, machine_gpus, my_gpus,
                              owned)

# (machines, GPUs per machine, processes per machine, the GPUs of each global rank, rank 0 first)
LAYOUTS = [
    (1, 4, 1, [["0", "1", "2", "3"]]),
    (1, 4, 2, [["0", "1"], ["2", "3"]]),
    (1, 4, 4, [["0"], ["1"], ["2"], ["3"]]),
    (2, 2, 2, [["0"], ["1"], ["0"], ["1"]]),   # global ranks 2 and 3 are slots 0 and 1 of the second machine
    (2, 2, 1, [["0", "1"], ["0", "1"]]),
    (2, 4, 2, [["0", "1"], ["2", "3"], ["0", "1"], ["2", "3"]]),
]


def owned_gpus(framework, env, machine, per_process, world):
    """The machine's GPU ids a worker started with `env` owns: what it sees, then the rule."""
    seen = machine_gpus(env) if HIDE in env else machine
    return [seen[i] for i in my_gpus(framework, len(seen), per_process, world, environ=env)]


def slot_env(framework, local_rank, local_world):
    """A hand launch that names the local slot the framework's way (torchrun's variables for PyTorch)."""
    return dict(zip(LAUNCHER_VARS.get(framework, OURS), (str(local_rank), str(local_world))))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("machines,gpus,local_world,expected", LAYOUTS)
def test_each_rank_owns_its_own_gpus_by_local_rank(framework, machines, gpus, local_world, expected):
    world = machines * local_world
    per_process = len(expected[0])
    got = [owned_gpus(framework, slot_env(framework, rank % local_world, local_world),
                      [str(i) for i in range(gpus)], per_process, world) for rank in range(world)]
    assert got == expected


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("machines,gpus,local_world,expected", LAYOUTS)
def test_a_worker_shown_only_its_gpus_takes_them_all(framework, machines, gpus, local_world, expected):
    """TensorFlow's multi-worker guide: CUDA_VISIBLE_DEVICES per worker, no rank variable at all."""
    world = machines * local_world
    machine = [str(i) for i in range(gpus)]
    for mine in expected:
        assert owned_gpus(framework, {HIDE: ",".join(mine)}, machine, len(mine), world) == mine


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("machines,gpus,local_world,expected", [layout for layout in LAYOUTS if layout[0] == 1])
def test_compare_launcher_gives_each_worker_its_gpus_and_slot(framework, machines, gpus, local_world, expected):
    machine = [str(i) for i in range(gpus)]
    workers, _ = engine_env(framework, local_world, devices=sum(map(len, expected)), gpus=machine)
    assert len(workers) == local_world
    rank_var, size_var = LAUNCHER_VARS.get(framework, OURS)
    for rank, (env, mine) in enumerate(zip(workers, expected)):
        assert (env[rank_var], env[size_var]) == (str(rank), str(local_world))
        if framework in HIDES_GPUS:   # its engine replicates onto every GPU it sees: it sees only its own
            assert env[HIDE] == ",".join(mine)
        else:   # addressed by index: every worker sees the machine, as under torchrun
            assert HIDE not in env
        assert owned_gpus(framework, env, machine, len(mine), local_world) == mine


def test_compare_launcher_sets_what_each_framework_launcher_sets():
    env = engine_env("pytorch", 2, devices=2, gpus=[])[0][1]
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")} == {
        "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    env = engine_env("tensorflow", 2, devices=2, gpus=[])[0][1]
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert (env["ROSETTA_LOCAL_RANK"], env["ROSETTA_LOCAL_WORLD_SIZE"]) == ("1", "2")
    workers, helpers = engine_env("mxnet", 2, devices=2, gpus=[])
    assert [w["DMLC_ROLE"] for w in workers] == ["worker", "worker"] and [n for n, _ in helpers] == ["scheduler", "server"]
    assert [(w["ROSETTA_LOCAL_RANK"], w["ROSETTA_LOCAL_WORLD_SIZE"]) for w in workers] == [("0", "2"), ("1", "2")]
    for framework in FRAMEWORKS:   # no GPU: nothing to hide
        assert all(HIDE not in env for env in engine_env(framework, 2, devices=2, gpus=[])[0])


def test_the_launcher_shares_out_the_gpus_it_was_given():
    """A launcher started with CUDA_VISIBLE_DEVICES=4,5,6,7 hands those out, not 0-3."""
    machine = machine_gpus({HIDE: "4,5,6,7"})
    workers, _ = engine_env("tensorflow", 2, devices=4, gpus=machine)
    assert [env[HIDE] for env in workers] == ["4,5", "6,7"]


def test_too_few_gpus_hides_nothing_and_the_worker_says_why():
    workers, _ = engine_env("tensorflow", 4, devices=4, gpus=["0", "1"])
    assert all(HIDE not in env for env in workers)
    with pytest.raises(RosettaError, match=r"asked for 4 processes x 1 GPU\(s\) on this machine, but this "
                                           r"process sees only 2"):
        owned_gpus("tensorflow", workers[3], ["0", "1"], 1, 4)


def test_several_processes_on_one_gpu_are_refused():
    """torchrun --nproc-per-node=2 on a 1-GPU machine: not both on GPU 0."""
    with pytest.raises(RosettaError, match="2 processes x 1 GPU"):
        owned_gpus("pytorch", slot_env("pytorch", 1, 2), ["0"], 1, 2)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_unknown_slot_on_a_shared_machine_is_an_error_not_a_guess(framework):
    """Without a local rank, the global rank is no slot (on a second machine rank 2 is slot 0)."""
    with pytest.raises(RosettaError, match=f"local rank is unknown: start each worker with its own GPUs in "
                                           f"{HIDE}, or with {OURS[0]} and {OURS[1]}"):
        my_gpus(framework, 2, 1, 4, environ={})
    assert my_gpus(framework, 2, 2, 4, environ={}) == [0, 1]   # alone on its machine: all it sees
    assert my_gpus(framework, 4, 2, 1, environ={}) == [0, 1]   # one process: the first ones


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("local_rank,local_world,per_process", [(0, 1, 2), (1, 2, 1), (3, 4, 2)])
def test_cpu_virtual_devices_are_each_process_own(framework, local_rank, local_world, per_process):
    """No GPU: every process makes its own virtual devices and owns its first per_process."""
    env = slot_env(framework, local_rank, local_world)
    assert my_gpus(framework, 0, per_process, local_world, environ=env) == []
    assert local_devices(FakeFramework(0), [], per_process) == [f"cpu:{i}" for i in range(per_process)]


def test_bad_slot_variables_are_one_clear_error():
    with pytest.raises(RosettaError, match="LOCAL_RANK=2 is not a slot among LOCAL_WORLD_SIZE=2"):
        my_gpus("pytorch", 4, 1, 2, environ={"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(RosettaError, match="must be integers"):
        my_gpus("mxnet", 4, 1, 2, environ={"ROSETTA_LOCAL_RANK": "one"})


class FakeFramework:
    """The contract's device functions on a machine with `gpus` GPUs."""

    def __init__(self, gpus):
        self.gpus = gpus

    def gpu_count(self):
        return self.gpus

    def get_devices(self, n=None):
        kind = "gpu" if self.gpus else "cpu"
        return [f"{kind}:{i}" for i in range(n or max(self.gpus, 1))]


def test_local_devices_are_the_owned_gpus_handles():
    assert local_devices(FakeFramework(4), owned(4, 2, 1, 2), 2) == ["gpu:2", "gpu:3"]
    assert local_devices(FakeFramework(4), owned(4, 1, 3, 4), 1) == ["gpu:3"]


def test_machine_gpus_reads_the_launcher_visible_list_or_the_driver(tmp_path):
    assert machine_gpus({HIDE: "2,3"}) == ["2", "3"]
    assert machine_gpus({HIDE: "GPU-8f2a,GPU-11c0"}) == ["GPU-8f2a", "GPU-11c0"]   # UUIDs pass through
    assert machine_gpus({HIDE: "0,-1,2"}) == ["0"]   # CUDA stops at the first invalid entry
    assert machine_gpus({HIDE: ""}) == [] and machine_gpus({HIDE: "-1"}) == []
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:b1:00.0"):
        (tmp_path / bus).mkdir()
    assert machine_gpus({}, driver=str(tmp_path)) == ["0", "1", "2"]
    assert machine_gpus({}, driver=str(tmp_path / "absent")) == []
