"""However a run ends (Ctrl-C, SIGTERM, SIGHUP, SIGKILL of compare.py, a stalled worker), no process of
it is left and no finished row is lost; --resume finishes what an interruption left. Real processes,
found by the tag in their environment (conftest). What happens to the processes does not depend on the framework
they train with: the workers train with tests/stub_training.py (no framework), but for MXNet's, whose scheduler and
server are processes of their own that must end too."""
import json
import os
import re
import signal
import time

import pytest

from conftest import follow, framework_or_skip, log_of, processes_tagged, wait_for, wait_for_training

pytestmark = pytest.mark.slow   # every test here starts real worker processes

# Every signal with the stub, and MXNet's helpers once (a worker process, its scheduler and its server).
ENDINGS = [*[pytest.param("stub", s, id=f"stub-{s.name}") for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
           pytest.param("mxnet", signal.SIGTERM, id="mxnet-SIGTERM")]


def workers_of(engine, request):
    """The framework to name on the command line; the stub's workers train with no framework at all."""
    if engine == "stub":
        request.getfixturevalue("stub_workers")
        return "pytorch"
    framework_or_skip(engine)
    return engine


def rows_in(path):
    """The rows compare.py's JSON file holds right now (it is replaced atomically: never half a file)."""
    try:
        with open(path) as f:
            return json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return []


def text(err):
    return "".join(line for _, line in err)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine,signum", ENDINGS)
def test_a_signal_mid_row_ends_every_process_and_keeps_the_finished_rows(engine, signum, start_compare, tag,
                                                                         tmp_path, request):
    framework = workers_of(engine, request)
    out = tmp_path / "out.json"
    proc = start_compare("--frameworks", framework, "--processes", "1,2", "--epochs", "10", "--threads", "1",
                         "--json", str(out))
    wait_for(lambda: len(rows_in(out)) == 1, 180, "the first row")
    wait_for_training(tag, 2)   # the second row's two processes (and MXNet's helpers) are mid-training
    proc.send_signal(signum)
    _, err = follow(proc)
    assert proc.returncode == 128 + signum, text(err)
    wait_for(lambda: not processes_tagged(tag), 3, "every process of the run gone 3 s after compare.py exited")
    assert f"interrupted by {signum.name}; 1 of 2 rows finished, kept in {out}" in text(err)
    assert "Traceback" not in text(err)
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert report["not_run"] == [f"{framework} scratch (default), 2 device(s), 2 process(es)"]
    assert [(r["processes"], r["status"], len(r["epoch_losses"])) for r in report["runs"]] == [(1, "ok", 10)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["stub", "mxnet"])
def test_workers_end_on_their_own_when_compare_is_killed(engine, start_compare, tag, request):
    """SIGKILL cannot be handled: each worker watches compare.py and ends (with its group) when it is gone, and
    removes the run's log folder, which compare.py had no chance to remove. MXNet's scheduler and server too, which
    never return from `import mxnet`."""
    framework = workers_of(engine, request)
    proc = start_compare("--frameworks", framework, "--processes", "2", "--epochs", "1000", "--threads", "1")
    (worker, *_) = wait_for_training(tag, 2)
    logs = os.path.dirname(os.readlink(f"/proc/{worker}/fd/2"))
    proc.kill()
    proc.wait()
    wait_for(lambda: not processes_tagged(tag), 10, "the workers ending after compare.py was SIGKILLed")
    assert not os.path.exists(logs), os.listdir(logs)


@pytest.mark.timeout(240)
def test_resume_runs_exactly_the_rows_an_interruption_left(start_compare, tag, tmp_path, stub_workers):
    out = tmp_path / "out.json"
    command = ["--frameworks", "pytorch", "--devices", "1,2", "--threads", "1", "--json", str(out), "--epochs", "3"]
    proc = start_compare(*command)
    wait_for(lambda: len(rows_in(out)) == 1, 180, "the first row")
    proc.send_signal(signal.SIGTERM)
    follow(proc)
    assert proc.returncode == 143
    (first,) = json.loads(out.read_text())["runs"]

    proc = start_compare(*command, "--resume")
    table, err = follow(proc)
    assert proc.returncode == 0, text(err)
    assert [line for _, line in err if line.startswith(("running", "kept"))] == [
        f"kept {first['row']}: ok (1 trial(s) from {out})\n",
        "running pytorch scratch (default), 2 device(s), 1 process(es) ...\n"]
    report = json.loads(out.read_text())
    assert report["complete"] is True and report["not_run"] == []
    kept, second = report["runs"]
    assert (kept["devices"], second["devices"], second["status"]) == (1, 2, "ok")
    for key in ("train_seconds", "startup_seconds", "step_losses", "test_accuracy"):   # the same run, not a re-run
        assert kept[key] == first[key], key
    assert table.count("| pytorch") == 2

    complete = out.read_bytes()
    proc = start_compare(*command, "--epochs", "4", "--resume")   # the last --epochs counts
    _, err = follow(proc)
    assert proc.returncode == 2 and len(err) == 1
    assert text(err).startswith(f"error: --resume: {out} holds a run with other settings (epochs 3 there, 4 here)")
    other_data = json.loads(complete)
    other_data["dataset"]["fingerprint"] = "0" * 16
    out.write_text(json.dumps(other_data))
    proc = start_compare(*command, "--resume")
    _, err = follow(proc)
    assert proc.returncode == 2 and len(err) == 1 and "holds a run on other data" in text(err), text(err)


@pytest.mark.timeout(240)
def test_a_stalled_worker_fails_its_row_and_the_next_row_runs(start_compare, tag, stub_workers):
    proc = start_compare("--frameworks", "pytorch", "--processes", "2,1", "--epochs", "10", "--threads", "1",
                         "--stall-timeout", "3")
    workers = wait_for_training(tag, 2)
    silent = next(p for p in workers if "progress " not in log_of(p))   # rank 1: rank 0 reports, then waits for it
    os.kill(silent, signal.SIGSTOP)
    stopped = time.monotonic()
    out, err = follow(proc)
    assert proc.returncode == 1, text(err)
    (failed_at, line), = [(t, line) for t, line in err if line.startswith("  failed")]
    assert re.fullmatch(r"  failed: stalled after step \d+ of 60: no progress for 3 s\n", line), line
    assert 2 < failed_at - stopped < 15
    rows = [line for line in out.splitlines() if line.startswith("| pytorch")]
    assert "failed: stalled" in rows[0] and rows[1].rstrip(" |").endswith("ok")
