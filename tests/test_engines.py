"""Every mode and process count computes the in-process scratch step, and every process ends."""
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from common import FRAMEWORKS
from common.optim import Optimizer
from harness.processes.launch import run_workers
from harness.spec import RunSpec
from conftest import assert_evaluated_together, follow, framework_or_skip, processes_by_role, run_compare, \
    run_processes, skip_not_installed, wait_for_training

pytestmark = pytest.mark.slow   # every test here starts real worker processes

# (mode, devices, processes): PyTorch's row is 2 processes of DDP. The scratch step on 2 processes is
# test_hand_launched_workers_compute_the_same_step's; every engine across 2 processes is test_optimizers.py's
# test_engines_compute_the_spec (with AdamW, step by step).
CONFIGS = [("builtin", 2, 1)]


# One step of the recipe on 97 digits: every engine and process count against the scratch step in this process.
STEP = {"dataset": "digits", "epochs": 1, "batch_size": 97, "lr": 0.2, "seed": 5, "threads": 1, "max_steps": 1}


def one_step(framework, mode, devices, processes, tmp_path, allreduce="per-tensor"):
    out = tmp_path / f"{framework}-{mode}-{devices}-{processes}-{allreduce}.npz"
    spec = {"framework": framework, "mode": mode, "devices": devices, "processes": processes, **STEP,
            "weights_out": str(out), "allreduce": allreduce}
    results = run_workers(spec, timeout=240)
    if results[0]["status"] == "skipped":   # Unavailable: the framework is not installed
        skip_not_installed(results[0]["error"])
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    loss = sum(r["step_loss_sums"][0] for r in results) / sum(r["step_sizes"][0] for r in results)
    assert len({r["digest"] for r in results}) == 1, "processes hold different weights"
    return loss, dict(np.load(out))


@pytest.fixture
def reference(recipe_runs):
    """(loss, weights) of the scratch step on 2 devices in this process, per framework: one_step's step, run once a
    session (conftest.recipe_runs)."""
    def get(framework):
        framework_or_skip(framework)
        spec = RunSpec(framework=framework, mode="scratch", devices=2, **STEP)
        weights, _, record = recipe_runs(spec, Optimizer(lr=STEP["lr"]))
        return record["step_loss_sums"][0] / record["step_sizes"][0], weights
    return get


@pytest.mark.parametrize("mode,devices,processes", CONFIGS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_mode_computes_the_scratch_step(framework, mode, devices, processes, reference, tmp_path):
    framework_or_skip(framework)
    ref_loss, ref_weights = reference(framework)
    world = devices if (framework, mode) == ("pytorch", "builtin") else processes
    loss, weights = one_step(framework, mode, devices, world, tmp_path)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_bucketed_all_reduce_across_processes_is_the_recipe_s_step(framework, reference, tmp_path):
    """--allreduce bucketed, 2 processes of a device each: the flat buckets cross the processes' collective (gloo, the
    kvstore under keys of their own, TensorFlow's ring, JAX's process mesh) and give the in-process per-tensor step."""
    framework_or_skip(framework)
    ref_loss, ref_weights = reference(framework)
    loss, weights = one_step(framework, "scratch", 2, 2, tmp_path, allreduce="bucketed")
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=name)


def test_jax_s_bucketed_builtin_step_across_processes_is_the_recipe_s_step(reference, tmp_path):
    """--mode builtin --allreduce bucketed, JAX's only: its shard_map form's flat psum across 2 processes (gloo)."""
    framework_or_skip("jax")
    ref_loss, ref_weights = reference("jax")
    loss, weights = one_step("jax", "builtin", 2, 2, tmp_path, allreduce="bucketed")
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=name)


def kill_mid_row(framework, victim, start_compare, tag):
    """Kill one process of a 2-process row (a worker, or an MXNet helper by its DMLC_ROLE) while it
    trains: that row fails within seconds, saying who died, and the next row runs."""
    proc = start_compare("--frameworks", framework, "--processes", "2,1", "--epochs", "10", "--threads", "1")
    wait_for_training(tag, 2)
    (pid, *_) = processes_by_role(tag, victim)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    out, err = follow(proc)
    assert proc.returncode == 1, err
    (failed_at, _), = [(t, line) for t, line in err if line.startswith("  failed")]
    assert failed_at - killed < 15, "the row failed only after its other processes gave up"
    lines = [line for line in out.splitlines() if line.startswith(f"| {framework}")]
    assert "killed by signal 9" in lines[0], lines[0]
    assert lines[1].rstrip(" |").endswith("ok"), lines[1]
    return lines[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("helper", ["scheduler", "server"])
def test_a_killed_mxnet_helper_fails_its_row_and_keeps_the_others(helper, start_compare, tag):
    framework_or_skip("mxnet")
    row = kill_mid_row("mxnet", helper, start_compare, tag)
    assert f"failed: mxnet {helper} killed by signal 9" in row, row


def long_spec(framework="pytorch"):
    return {"framework": framework, "mode": "scratch", "devices": 2, "processes": 2, "dataset": "synthetic",
            "n_synthetic": 2000, "epochs": 10_000, "batch_size": 256, "lr": 0.1, "seed": 0, "threads": 1}


def in_background(fn):
    import threading
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()))
    thread.start()
    return thread, result


def test_a_dead_worker_stops_the_run_within_seconds(tag, stub_workers):
    """Its peer would wait in the next step's collective forever (the stub's lockstep: tests/stub_training.py)."""
    thread, result = in_background(lambda: run_workers(long_spec(), timeout=120))
    workers = wait_for_training(tag, 2)
    os.kill(workers[-1], signal.SIGKILL)
    start = time.monotonic()
    thread.join(60)
    assert not thread.is_alive() and time.monotonic() - start < 60
    assert result["value"][0]["status"] == "failed" and "killed by signal 9" in result["value"][0]["error"]


def test_a_killed_worker_is_named_as_the_cause_when_its_peer_fails_at_once(tag, stub_workers, monkeypatch):
    """A worker SIGKILLed: its peer's collective breaks and the peer fails cleanly, with its record, at once (gloo's
    read error, TensorFlow's UnavailableError), so both are found dead together. The run's error is the kill."""
    from stub_training import PEER_LOSS_VARIABLE
    monkeypatch.setenv(PEER_LOSS_VARIABLE, "1")
    thread, result = in_background(lambda: run_workers(long_spec(), timeout=120))
    workers = wait_for_training(tag, 2)
    os.kill(workers[-1], signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert result["value"][0]["status"] == "failed" and "killed by signal 9" in result["value"][0]["error"], \
        result["value"][0]["error"]


def test_a_worker_that_aborts_after_writing_its_record_loses_no_result(tag, stub_workers, monkeypatch, capsys):
    """A process may crash as its interpreter exits, after the worker wrote its record (PyTorch's gloo can: a race at
    exit). Its record is whole: the others are not stopped, every rank's record comes back, and a note says how the
    process ended. It is not taken for a failure's record, nor returned alone as the run's."""
    from stub_training import ABORT_AT_EXIT_VARIABLE
    monkeypatch.setenv(ABORT_AT_EXIT_VARIABLE, "0")
    results = run_workers({**long_spec(), "epochs": 2}, timeout=120)
    assert [r["status"] for r in results] == ["ok", "ok"] and [r["rank"] for r in results] == [0, 1]
    assert "note: worker 0 of 2 killed by signal 6 after writing its record (kept)" in capsys.readouterr().err


def test_a_worker_ends_once_its_record_is_written_with_its_exit_handlers_run(tag, stub_workers, monkeypatch, tmp_path):
    """After its record a worker ends as the interpreter begins to: its open thread pools finish their work (and
    torch.compile's threads end), its atexit handlers run (TensorFlow's removes AutoGraph's files), what C code
    buffered is written; but not the interpreter's teardown of every module and C++ object, which took TensorFlow 1.3 s
    a row: an object freed only by that teardown is never freed. Every rank's record comes back."""
    import contextlib
    import tempfile
    from stub_training import EXIT_MARKERS_VARIABLE
    monkeypatch.setenv(EXIT_MARKERS_VARIABLE, str(tmp_path))
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)   # which leaves C's output unbuffered too
    logs = tmp_path / "logs"   # the run's log folder, kept to be read
    logs.mkdir()
    monkeypatch.setattr(tempfile, "TemporaryDirectory", lambda prefix: contextlib.nullcontext(str(logs)))
    results = run_workers({**long_spec(), "epochs": 1}, timeout=60)
    assert [r["status"] for r in results] == ["ok", "ok"], results[0].get("error")
    assert sorted(os.listdir(tmp_path)) == ["atexit-0", "atexit-1", "logs", "pool-0", "pool-1"]   # no teardown-0, -1
    for rank in (0, 1):
        assert f"written by C, rank {rank}" in (logs / f"worker{rank}.log").read_text()


@pytest.mark.parametrize("files_held", [0, 1100])
def test_a_row_comes_back_as_its_last_worker_ends_not_a_poll_later(tag, stub_workers, monkeypatch, files_held):
    """The launcher looks at a run's progress, stall and timeout every POLL_SECONDS, but wakes as soon as a worker
    ends: with a poll of a minute, a two-process row of under a second still comes back in seconds. Also from a
    launcher holding over a thousand files, as a process that imported four frameworks may: its workers' pidfds are
    numbered past 1024, which select.select cannot watch."""
    import resource
    from harness.processes import launch
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    if limits[0] != resource.RLIM_INFINITY and limits[0] < files_held + 100:   # only the soft limit, only raised
        resource.setrlimit(resource.RLIMIT_NOFILE, (files_held + 100, limits[1]))
    monkeypatch.setattr(launch, "POLL_SECONDS", 60)
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(files_held)]
    try:
        start = time.monotonic()
        results = run_workers({**long_spec(), "epochs": 2}, timeout=120)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert [r["status"] for r in results] == ["ok", "ok"], results[0].get("error")
    assert time.monotonic() - start < 20


def test_a_timeout_ends_every_process(tag, stub_workers):
    start = time.monotonic()
    (result,) = run_workers(long_spec(), timeout=8)
    assert result["status"] == "failed" and "timed out after 8 s" in result["error"]
    assert time.monotonic() - start < 20


def launch_by_hand(framework, spec, folder):
    """The hand launches of docs/usage.md on one machine: torchrun; TF_CONFIG per worker; DMLC_* for a
    scheduler, a server and the workers; JAX_* per process. Nothing from compare.py or harness.processes.launch."""
    import json
    from harness.processes.cluster import free_ports
    worker = [sys.executable, "-m", "harness.run.worker", json.dumps(spec)]
    out = str(folder / "out-{rank}.json")
    ports = free_ports(3)
    if framework == "pytorch":
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        commands = [([torchrun, "--standalone", "--nproc-per-node=2", "-m", "harness.run.worker", json.dumps(spec), out], {})]
    elif framework == "tensorflow":
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
        commands = [(worker + [out], {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})})
                    for i in range(2)]
    elif framework == "jax":
        coordinator = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{ports[0]}", "JAX_NUM_PROCESSES": "2"}
        commands = [(worker + [out], {**coordinator, "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    else:
        dmlc = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(ports[0]), "DMLC_NUM_SERVER": "1",
                "DMLC_NUM_WORKER": "2", "DMLC_NODE_HOST": "127.0.0.1", "DMLC_INTERFACE": "lo"}
        commands = [(worker + [os.devnull], {**dmlc, "DMLC_ROLE": role}) for role in ("scheduler", "server")]
        commands += [(worker + [out], {**dmlc, "DMLC_ROLE": "worker"}) for _ in range(2)]
    run_processes(commands)
    return sorted(str(f) for f in folder.glob("*.json"))


@pytest.fixture(scope="module")
def hand_launched(tmp_path_factory):
    """One step of a 2-process scratch run per framework, launched by hand (computed once)."""
    cache = {}

    def get(framework):
        framework_or_skip(framework)
        if framework not in cache:
            folder = tmp_path_factory.mktemp(f"hand-{framework}")
            spec = {"framework": framework, "mode": "scratch", "devices": 2, "processes": 2, **STEP,
                    "weights_out": str(folder / "weights.npz")}
            cache[framework] = (launch_by_hand(framework, spec, folder), dict(np.load(folder / "weights.npz")))
        return cache[framework]
    return get


def merge(*paths):
    out = os.path.join(os.path.dirname(paths[0]), "merged.json")
    proc = run_compare("--merge", *paths, "--json", out, timeout=120)
    runs = json.load(open(out))["runs"] if proc.returncode in (0, 1) else None
    return proc, runs


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hand_launched_workers_compute_the_same_step(framework, hand_launched, reference, digits):
    """The hand launch of docs/usage.md gives the in-process step, the test split evaluated by both processes
    together, and --merge turns its files into the row."""
    files, weights = hand_launched(framework)
    ref_loss, ref_weights = reference(framework)
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=name)
    records = [json.load(open(f)) for f in files]
    assert_evaluated_together(records, framework_or_skip(framework), weights, digits)
    proc, runs = merge(*files)
    assert proc.returncode == 0, proc.stderr
    (run,) = runs
    assert (run["framework"], run["processes"], run["status"], run["evaluated_by"]) == (framework, 2, "ok", 2)
    assert run["step_losses"][0] == pytest.approx(ref_loss, abs=1e-5)
    assert f"| {framework}" in proc.stdout


def test_merge_puts_several_runs_side_by_side(hand_launched):
    files = hand_launched("pytorch")[0] + hand_launched("tensorflow")[0]
    proc, runs = merge(*files)
    assert proc.returncode == 0, proc.stderr
    assert [(r["framework"], r["status"]) for r in runs] == [("pytorch", "ok"), ("tensorflow", "ok")]
    assert runs[1]["step1_loss_diff"] <= 1e-5   # the parity column, across the two hand-launched runs


def test_merge_refuses_incomplete_and_diverged_runs(hand_launched):
    import json
    files, _ = hand_launched("pytorch")
    rank0, rank1 = (f for f in files if f.endswith(("out-0.json", "out-1.json")))
    proc, _ = merge(rank0)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: pytorch scratch run of 2 processes: found rank(s) 0; give one file per rank"]
    drifted = os.path.join(os.path.dirname(rank1), "drifted-1.json")
    record = json.load(open(rank1))
    json.dump({**record, "digest": "0" * len(record["digest"])}, open(drifted, "w"))
    proc, runs = merge(rank0, drifted)
    assert proc.returncode == 1 and runs[0]["status"] == "failed"
    assert runs[0]["error"] == "the processes ended with different weights"
    rescaled = os.path.join(os.path.dirname(rank1), "rescaled-1.json")   # fp16: one skipped a step the other took
    json.dump({**record, "final_loss_scale": 1.0}, open(rescaled, "w"))
    proc, runs = merge(rank0, rescaled)
    assert proc.returncode == 1 and runs[0]["error"] == "the processes ended at different loss scales"
    garbage = os.path.join(os.path.dirname(rank1), "garbage.json")
    open(garbage, "w").write("{not json")
    proc, _ = merge(rank0, garbage)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"error: {garbage}: cannot be read as a worker's JSON record")
