"""Where a run's processes are (harness/processes/cluster.py), a SLURM job read the way `scontrol show hostnames` reads it
(harness/processes/slurm.py), and where a restarted run starts again (harness.training.checkpoints.latest_checkpoint). No process is
started here: these are the variables and choices the two-host, SLURM and restart tests then run with."""
import json

import pytest

from common import FRAMEWORKS, RosettaError
from common.lenet import init_weights
from common.placement import HIDE
from harness.training.checkpoints import LATEST, checkpoint_name, latest_checkpoint, state_path, write_weights
from harness.processes.cluster import Cluster, engine_env, interface_of
from harness.publishing.tables import processes_cell, status
from harness.processes.slurm import expand_counts, expand_nodelist, job, started_by_srun, task_env
from harness.spec import RunSpec
from conftest import framework_or_skip

TWO = Cluster(("10.0.0.1", "10.0.0.2"), node_rank=1, port=29500, interface="eth7")


def test_a_host_takes_its_block_of_ranks_and_the_coordinator_is_the_first_host():
    assert list(TWO.ranks(4)) == [2, 3] and list(Cluster().ranks(2)) == [0, 1]
    with pytest.raises(RosettaError, match="cannot be shared out evenly over 2 hosts"):
        TWO.ranks(3)
    with pytest.raises(RosettaError, match="node rank 2 is not one of the 2 hosts"):
        Cluster(("a", "b"), node_rank=2, port=1)
    with pytest.raises(RosettaError, match="needs a port agreed on by all of them"):
        Cluster(("a", "b"))


def test_every_engine_gets_the_coordinator_and_this_hosts_interface():
    """Host 1 of 2, 4 processes: its workers are ranks 2 and 3, local ranks 0 and 1."""
    env = engine_env("pytorch", 4, 4, gpus=[], cluster=TWO)[0]
    assert [(e["RANK"], e["LOCAL_RANK"], e["MASTER_ADDR"], e["MASTER_PORT"], e["GLOO_SOCKET_IFNAME"]) for e in env] == [
        ("2", "0", "10.0.0.1", "29500", "eth7"), ("3", "1", "10.0.0.1", "29500", "eth7")]
    workers, helpers = engine_env("tensorflow", 4, 4, gpus=[], cluster=TWO)
    configs = [json.loads(e["TF_CONFIG"]) for e in workers]
    assert configs[0]["cluster"]["worker"] == ["10.0.0.1:29501", "10.0.0.1:29502", "10.0.0.2:29501", "10.0.0.2:29502"]
    assert [c["task"]["index"] for c in configs] == [2, 3] and helpers == []
    workers, helpers = engine_env("mxnet", 4, 4, gpus=[], cluster=TWO)
    assert {(e["DMLC_PS_ROOT_URI"], e["DMLC_NODE_HOST"], e["DMLC_INTERFACE"], e["DMLC_NUM_SERVER"]) for e in workers} \
        == {("10.0.0.1", "10.0.0.2", "eth7", "2")}
    assert [role for role, _ in helpers] == ["server"]   # the scheduler is the first host's
    assert [role for role, _ in engine_env("mxnet", 4, 4, gpus=[], cluster=Cluster(
        TWO.hosts, 0, 29500, "eth7"))[1]] == ["scheduler", "server"]
    env = engine_env("jax", 4, 4, gpus=[], cluster=TWO)[0]
    assert [(e["JAX_COORDINATOR_ADDRESS"], e["JAX_PROCESS_ID"], e["GLOO_SOCKET_IFNAME"]) for e in env] == [
        ("10.0.0.1:29500", "2", "eth7"), ("10.0.0.1:29500", "3", "eth7")]


def test_one_host_runs_on_loopback_with_free_ports():
    (env,), _ = engine_env("pytorch", 1, 1, gpus=[])
    assert (env["MASTER_ADDR"], env["GLOO_SOCKET_IFNAME"]) == ("127.0.0.1", "lo") and int(env["MASTER_PORT"]) > 0


def test_the_interface_is_the_one_holding_the_hosts_address():
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(RosettaError, match="no network interface of this machine holds 192.0.2.123"):
        interface_of("192.0.2.123")


@pytest.mark.parametrize("text,names", [
    ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b", ["a", "b"]), ("h[9-11]", ["h9", "h10", "h11"]), ("x[008-010]", ["x008", "x009", "x010"])])
def test_a_slurm_node_list_expands_as_scontrol_does(text, names):
    assert expand_nodelist(text) == names


def test_slurm_task_counts_and_bad_lists():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1] and expand_counts("4") == [4]
    with pytest.raises(RosettaError, match="cannot read the SLURM node list"):
        expand_nodelist("node[a-b]")
    with pytest.raises(RosettaError, match="tasks per node"):
        expand_counts("2(y3)")


def slurm(rank, nodes=2, per_node=2, **extra):
    node, local = divmod(rank, per_node)
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(nodes * per_node), "SLURM_NODEID": str(node),
            "SLURM_LOCALID": str(local), "SLURM_JOB_NODELIST": f"127.0.0.[1-{nodes}]", "SLURM_JOB_ID": "123",
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})", **extra}


def test_a_slurm_task_knows_its_place_in_the_job():
    cluster, rank, world = job(slurm(3))
    assert (cluster.hosts, cluster.node_rank, cluster.port, rank, world) == (("127.0.0.1", "127.0.0.2"), 1, 20123, 3, 4)
    assert job(slurm(3, MASTER_PORT="4000"))[0].port == 4000
    with pytest.raises(RosettaError, match="give every node the same number"):
        job({**slurm(0), "SLURM_TASKS_PER_NODE": "3,1"})
    with pytest.raises(RosettaError, match="out of block order"):
        job({**slurm(1), "SLURM_NODEID": "1"})   # srun --distribution=cyclic: task 1 on the second node


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_slurm_task_gets_what_its_engines_launcher_would_set(framework, monkeypatch):
    """A 2 x 2 job on one machine's loopback addresses (127.0.0.1 and .2 are both lo's): task 3 is rank 3, local
    rank 1 on the second node; MXNet's first task of each node starts the node's server, task 0 the scheduler too."""
    spec = RunSpec(framework, mode="builtin", devices=4, processes=4)
    monkeypatch.setattr("harness.processes.cluster.interface_of", lambda address: "lo")
    env, helpers = task_env(spec, slurm(3))
    expected = {"pytorch": ("RANK", "3"), "jax": ("JAX_PROCESS_ID", "3"), "mxnet": ("DMLC_ROLE", "worker")}
    if framework == "tensorflow":
        assert json.loads(env["TF_CONFIG"])["task"]["index"] == 3
    else:
        name, value = expected[framework]
        assert env[name] == value
    assert helpers == []
    roles = [role for role, _ in task_env(spec, slurm(0))[1]]
    assert roles == (["scheduler", "server"] if framework == "mxnet" else [])
    assert [role for role, _ in task_env(spec, slurm(2))[1]] == (["server"] if framework == "mxnet" else [])
    with pytest.raises(RosettaError, match="has 4 tasks but the run asks for 2 processes"):
        task_env(spec.replace(processes=2, devices=2), slurm(0))


def test_slurm_gpus_per_node_are_shared_out_by_local_rank(monkeypatch):
    """4 GPUs a node, 2 tasks a node, 8 devices: TensorFlow's task 3 (local 1) sees GPUs 2 and 3 only."""
    monkeypatch.setattr("harness.processes.cluster.interface_of", lambda address: "lo")
    monkeypatch.setattr("harness.processes.cluster.machine_gpus", lambda: ["0", "1", "2", "3"])
    env, _ = task_env(RunSpec("tensorflow", mode="builtin", devices=8, processes=4), slurm(3))
    assert env[HIDE] == "2,3" and env["ROSETTA_LOCAL_RANK"] == "1"


def test_only_a_task_nothing_else_placed_reads_slurm():
    assert started_by_srun(slurm(0))
    assert not started_by_srun({**slurm(0), "ROSETTA_PARENT_PID": "1"})   # compare.py's worker inside an allocation
    assert not started_by_srun({**slurm(0), "RANK": "0"})   # torchrun inside the job said it already
    assert not started_by_srun({})


def checkpoints(tmp_path, epochs):
    spec = RunSpec("pytorch", mode="builtin", devices=2, processes=2, epochs=4, checkpoint_dir=str(tmp_path))
    for epoch in epochs:
        write_weights("pytorch", init_weights(epoch), str(tmp_path / checkpoint_name(spec, epoch)))
    return spec


def test_a_restart_starts_from_the_newest_checkpoint_that_reads_back(tmp_path):
    framework_or_skip("pytorch")
    spec = checkpoints(tmp_path, [1, 2, 3])
    (tmp_path / checkpoint_name(spec, 3)).write_bytes(b"cut short by a dying disk")
    warnings = []
    assert latest_checkpoint(spec, warnings.append) == str(tmp_path / checkpoint_name(spec, 2))
    (warning,) = warnings
    assert warning.startswith(f"warning: not resuming from {checkpoint_name(spec, 3)}: {tmp_path / checkpoint_name(spec, 3)}: "
                              "not a readable PyTorch state_dict (torch.save, or Distributed Checkpoint) file, or truncated (")
    assert warning.endswith("); trying the one before it")


def test_a_stateful_run_never_restarts_from_weights_without_their_state(tmp_path):
    """The state is written first: weights without it were cut short (or saved by another optimizer's run)."""
    framework_or_skip("pytorch")
    spec = checkpoints(tmp_path, [1]).replace(optimizer="momentum")
    warnings = []
    assert latest_checkpoint(spec, warnings.append) is None and "no optimizer state beside it" in warnings[0]
    assert latest_checkpoint(spec.replace(resume_from=LATEST), warnings.append) is None
    given = str(tmp_path / "given-epoch1.pt")
    assert latest_checkpoint(spec.replace(resume_from=given), warnings.append) == given   # nothing newer
    assert not (tmp_path / state_path("pytorch", checkpoint_name(spec, 1))).exists()


def test_a_row_says_where_it_ran_and_what_it_survived():
    row = {"status": "ok", "processes": 2, "hosts": ["10.77.0.1", "10.77.0.2"], "restarts": 1, "lost_seconds": 9.04}
    assert processes_cell(row) == "2 on 2 hosts" and processes_cell({"processes": 2}) == "2"
    assert status(row) == "ok after 1 restart(s), 9.0 s lost"
    assert status({"status": "failed", "error": "worker 1 of 2 killed by signal 9", "restarts": 1}) == \
        "failed: worker 1 of 2 killed by signal 9 after 1 restart(s)"


@pytest.mark.parametrize("argv,message", [
    (["--hosts", "a"], "expected two or more different hosts"),
    (["--hosts", "a,b", "--processes", "3"], "--processes 3 is not a multiple of 2"),
    (["--hosts", "a,b", "--processes", "2", "--node-rank", "2"], "--node-rank must be between 0 and 1"),
    (["--node-rank", "1"], "--node-rank, --port and --interface go with --hosts"),
    (["--max-restarts", "1"], "--max-restarts needs --checkpoint-dir"),
])
def test_bad_cluster_options_get_one_line(argv, message, capsys):
    import compare
    with pytest.raises(SystemExit) as exit:
        compare.parse_args(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err
