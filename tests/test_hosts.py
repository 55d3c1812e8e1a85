"""Every engine across two real hosts (tests/hosts.py: two network namespaces joined by a veth pair, addresses
10.77.0.1 and 10.77.0.2, neither reachable from anywhere else): launched one command per host as compare.py's
--hosts does it, and as a SLURM job of 2 nodes x 2 tasks starts it. The weights at the end are the one-host run's,
bit for bit."""
import json
import os
import subprocess
import sys

import pytest

from common import FRAMEWORKS
import hosts
from harness.run.merge import merge_files
from harness.spec import RunSpec
from conftest import ROOT, engine_run_options, framework_or_skip

pytestmark = pytest.mark.slow   # real worker processes, on both hosts

ADDRESSES = ",".join(hosts.ADDRESSES)


def on_hosts(commands, timeout=240):
    """Run one command per host, all at once: [(host, argv, environment)] -> their (returncode, output)."""
    procs = [hosts.run_in(host, argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) for host, argv, env in commands]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_engine_trains_across_two_hosts_as_on_one(framework, two_hosts, one_host_rows, tmp_path):
    """compare.py on each host with --hosts and its --node-rank: the coordinator on 10.77.0.1, every engine told the
    host's own interface. Both hosts end with the one-host run's weights (its digest); their per-step loss sums add up
    to the one-host run's losses."""
    framework_or_skip(framework)
    commands = [(h, [sys.executable, "compare.py", *engine_run_options([framework]), "--hosts", ADDRESSES,
                     "--node-rank", str(h), "--port", "29610", "--json", str(tmp_path / f"host{h}.json")], {})
                for h in (0, 1)]
    for code, output in on_hosts(commands):
        assert code == 0, output[-3000:]
    rows = []
    for h in (0, 1):
        with open(tmp_path / f"host{h}.json") as f:
            (row,) = json.load(f)["runs"]
        assert row["hosts"] == list(hosts.ADDRESSES) and row["node_rank"] == h
        rows.append(row)
    one = one_host_rows[framework]
    assert rows[0]["digest"] == rows[1]["digest"] == one["digest"]
    sums = [a + b for a, b in zip(rows[0]["step_loss_sums"], rows[1]["step_loss_sums"])]
    sizes = [a + b for a, b in zip(rows[0]["step_sizes"], rows[1]["step_sizes"])]
    assert [s / n for s, n in zip(sums, sizes)] == pytest.approx(one["step_losses"], rel=1e-12, abs=0)


SLURM_JOB = {"SLURM_JOB_NODELIST": "rosetta-h[0-1]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "4242",
             "SLURM_NNODES": "2", "SLURM_NTASKS": "4"}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_slurm_job_of_two_nodes_by_two_tasks_starts_every_engine(framework, two_hosts, tmp_path):
    """What `srun -N2 --ntasks-per-node=2 python -m harness.run.worker SPEC out-{rank}.json` starts: four tasks that know
    only SLURM's variables (the node list by host name, resolved by each host's own hosts file). Each maps the job to
    its engine; MXNet's first task on each node starts the node's server, task 0 the scheduler. The four ranks train
    together: the merged row is ok, one set of weights."""
    framework_or_skip(framework)
    spec = RunSpec(framework, mode="builtin", devices=4, processes=4, dataset="digits", epochs=1, threads=1,
                   max_steps=2)
    commands = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**SLURM_JOB, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local)}
        commands.append((node, [sys.executable, "-m", "harness.run.worker", spec.to_json(),
                                str(tmp_path / "out-{rank}.json")], env))
    for code, output in on_hosts(commands):
        assert code == 0, output[-3000:]
    outs = sorted(str(p) for p in tmp_path.glob("out-*.json"))
    assert len(outs) == 4
    _, (row,) = merge_files(outs)   # every rank once, the same data, the same weights
    assert row["status"] == "ok", row.get("error")
    records = [json.load(open(path)) for path in outs]
    if framework != "mxnet":   # MXNet's scheduler hands out the ranks in the order the workers reach it
        assert all(r["rank"] == int(os.path.basename(p)[4:-5]) for r, p in zip(records, outs))
