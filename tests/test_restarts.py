"""A worker killed mid-run is survived: the run's other processes are stopped within seconds (they would wait in
their collective, or on MXNet's server, forever), the group starts again from the last complete checkpoint, and the run ends with the weights the uninterrupted run ends with, bit for bit. By compare.py's
--max-restarts in every engine, and by torchrun's own --max-restarts (resume_from "latest")."""
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from common import FRAMEWORKS
from harness.run.merge import merge_files
from harness.spec import RunSpec
from conftest import ENGINE_RUN, ROOT, engine_run_options, follow, framework_or_skip, processes_tagged, wait_for


def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(v.decode(errors="replace").split("=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return {}


def kill_a_worker_after_the_first_checkpoint(folder, tag, is_worker, seed):
    """SIGKILL one worker at a random moment after the epoch-1 checkpoint is complete (the run is then in epoch 2)."""
    wait_for(lambda: glob.glob(os.path.join(folder, "*-epoch1.*")), 240, "the first checkpoint")
    time.sleep(random.Random(seed).uniform(0.0, 0.4))
    workers = sorted(p for p in processes_tagged(tag) if is_worker(environ(p)))
    assert workers, "no worker to kill: the run ended before the kill"
    os.kill(workers[-1], signal.SIGKILL)
    return time.monotonic()


@pytest.mark.slow   # real worker processes, killed and started again
@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_killed_worker_is_restarted_from_the_last_checkpoint(framework, start_compare, tag, one_host_rows, tmp_path):
    framework_or_skip(framework)
    proc = start_compare(*engine_run_options([framework]), "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1",
                         "--max-restarts", "1", "--json", str(tmp_path / "run.json"))
    killed = kill_a_worker_after_the_first_checkpoint(str(tmp_path), tag, lambda env: env.get(
        "DMLC_ROLE", "worker") == "worker" and "ROSETTA_PARENT_PID" in env, framework)
    out, err = follow(proc)
    lines = [line for _, line in err]
    assert proc.returncode == 0, "".join(lines)[-3000:]
    (failed_at, failed), = [(t, line) for t, line in err if line.startswith("  failed:")]
    assert "killed by signal 9" in failed and failed_at - killed < 15, "the others were stopped only when they gave up"
    assert any(line.startswith("  restart 1 of 1, from ") for line in lines), "".join(lines)
    with open(tmp_path / "run.json") as f:
        (row,) = json.load(f)["runs"]
    assert (row["status"], row["restarts"]) == ("ok", 1) and row["first_epoch"] in (1, 2) and row["lost_seconds"] > 0
    assert "ok after 1 restart(s)" in out
    assert row["digest"] == one_host_rows[framework]["digest"]   # the uninterrupted run's weights


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torchrun_restarts_the_group_and_it_resumes_from_the_latest_checkpoint(tag, one_host_rows, tmp_path):
    """torchrun's own restarts: the workers are started again with the same command line; resume_from "latest"
    makes them start from the newest complete checkpoint, as compare.py's restarts do. Which of the two torchrun names
    as the group's failure is a race (the killed one, or its peer whose collective broke, both in one second), so the
    proof it restarted is its own log line at LOGLEVEL=INFO and the row resumed. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    torchrun 2.13 otherwise hands the restarted workers its rendezvous store with the dead group's gloo addresses
    still in it ("Gloo connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712), measured here."""
    framework_or_skip("pytorch")
    spec = RunSpec("pytorch", dataset="digits", **ENGINE_RUN, checkpoint_dir=str(tmp_path), checkpoint_every=1,
                   resume_from="latest")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "-m",
                             "harness.run.worker", spec.to_json(), str(tmp_path / "out-{rank}.json")], cwd=ROOT,
                            env={**os.environ, "ROSETTA_TEST_TAG": tag, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                 "LOGLEVEL": "INFO"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        kill_a_worker_after_the_first_checkpoint(str(tmp_path), tag, lambda env: "LOCAL_RANK" in env, "torchrun")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "1/1 attempts left; will restart worker group" in err, err[-3000:]
    _, (row,) = merge_files(sorted(glob.glob(str(tmp_path / "out-*.json"))))
    assert row["status"] == "ok" and row["first_epoch"] in (1, 2)
    assert row["digest"] == one_host_rows["pytorch"]["digest"]


def test_the_time_a_restart_loses_is_the_work_after_the_checkpoint_and_the_restarted_startup(tmp_path, monkeypatch):
    """lost_seconds, with stub workers: the failed attempt's time after the checkpoint it is resumed from is thrown
    away, and the restarted processes start up again. Whatever the resumed epochs take (a first epoch that compiles
    is slow), nothing before the checkpoint counts."""
    from argparse import Namespace

    from harness.run import trials
    checkpoint = tmp_path / "pytorch-epoch1.pt"

    def run_workers(attempt, *args, **kwargs):
        if attempt.resume_from is None:   # epoch 1 saved after 0.2 s, then 0.3 s of epoch 2 before the kill
            time.sleep(0.2)
            checkpoint.write_bytes(b"weights")
            time.sleep(0.3)
            return "killed"
        return "resumed"
    monkeypatch.setattr(trials, "run_workers", run_workers)
    monkeypatch.setattr(trials, "merge_records", lambda records, fingerprint: {
        "status": "failed", "error": "killed by signal 9"} if records == "killed" else {
        "status": "ok", "first_epoch": 2, "startup_seconds": 0.5, "epoch_seconds_median": 100.0})
    asked = []
    monkeypatch.setattr(trials, "latest_checkpoint", lambda spec, warn, written_since: asked.append(written_since)
                        or str(checkpoint))
    began = time.time()
    args = Namespace(timeout=60, stall_timeout=None, cluster=None, max_restarts=1)
    result, _ = trials.supervise_restarts(RunSpec("pytorch", dataset="digits", epochs=3), {"fingerprint": ""}, args, "row")
    assert result["restarts"] == 1 and 0.3 + 0.5 <= result["lost_seconds"] < 0.3 + 0.5 + 0.15
    assert began <= asked[0] < began + 0.1   # only what this row wrote since it began


def test_a_restart_resumes_only_a_checkpoint_the_row_wrote(tmp_path):
    """A checkpoint's name says the row, not its rate, seed or data: another run's file in the same folder, of the same
    name, was resumed from, and the row ended "ok" with that run's weights trained one epoch more."""
    from common.lenet import init_weights
    from harness.training.checkpoints import checkpoint_name, latest_checkpoint, write_weights
    spec = RunSpec("pytorch", dataset="digits", epochs=4, checkpoint_dir=str(tmp_path))
    paths = [str(tmp_path / checkpoint_name(spec, epoch)) for epoch in (1, 2, 3)]
    for path in paths:
        write_weights("pytorch", init_weights(0), path)
    began = time.time()
    os.utime(paths[2], (began - 60, began - 60))   # epoch 3: another run's, a minute ago
    os.utime(paths[1], (began + 1, began + 1))     # epoch 2: this row's
    assert latest_checkpoint(spec, print) == paths[2]
    assert latest_checkpoint(spec, print, written_since=began) == paths[1]
    os.utime(paths[1], (began - 60, began - 60))
    os.utime(paths[0], (began - 60, began - 60))
    assert latest_checkpoint(spec, print, written_since=began) is None   # none of its own: from the start


def test_a_row_that_used_up_its_timeout_is_not_restarted(monkeypatch):
    """--timeout is the row's whole budget: a hang restarted --max-restarts times ran for that many timeouts."""
    from argparse import Namespace

    from harness.run import trials
    budgets = []

    def run_workers(attempt, timeout, **kwargs):
        budgets.append(timeout)
        time.sleep(0.2)
        return [{"status": "failed", "error": f"timed out after {timeout:g} s", "timed_out": True}] if len(
            budgets) > 1 else [{"status": "failed", "error": "worker 0 of 2 killed by signal 9"}]
    monkeypatch.setattr(trials, "run_workers", run_workers)
    monkeypatch.setattr(trials, "merge_records", lambda records, fingerprint: records[0])
    monkeypatch.setattr(trials, "latest_checkpoint", lambda spec, warn, written_since: None)
    args = Namespace(timeout=7.0, stall_timeout=None, cluster=None, max_restarts=3)
    result, _ = trials.supervise_restarts(RunSpec("pytorch", dataset="digits", epochs=3), {"fingerprint": ""}, args, "row")
    assert result["status"] == "failed" and result["restarts"] == 1 and len(budgets) == 2
    assert budgets[0] == pytest.approx(7.0, abs=0.01) and 6.6 < budgets[1] <= 6.8   # the second: what the first left
