"""Shared fixtures: each framework's implementation, skipped (with the reason) where it cannot load; a
time limit on every test; the real processes of a run, found by a tag in their environment."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import FRAMEWORKS, RosettaError  # noqa: E402
from harness.loader import load_framework  # noqa: E402


def framework_or_skip(name):
    try:
        return load_framework(name)
    except RosettaError as err:
        pytest.skip(str(err))


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return framework_or_skip(request.param)


@pytest.fixture(scope="session")
def digits():
    from common.data import load_dataset
    return load_dataset("digits")


TEST_SECONDS = 300   # no test can hang the suite: each fails after this (pytest.mark.timeout(s) sets another)


@pytest.fixture(autouse=True)
def time_limit(request):
    marker = request.node.get_closest_marker("timeout")
    seconds = marker.args[0] if marker else TEST_SECONDS

    def expire(signum, frame):
        pytest.fail(f"the test ran over its {seconds} s limit", pytrace=False)
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def processes_tagged(tag):
    """Live processes whose environment carries our tag (children inherit it, orphans too)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def role(pid):
    """'worker', or the helper an MXNet process is (scheduler, server): its DMLC_ROLE; None if it is not
    a worker process (compare.py, or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"harness.worker" not in f.read():
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    return env.get(b"DMLC_ROLE", b"worker").decode()


def log_of(pid):
    """What a worker has written so far (compare.py sends its stdout and stderr to a log file)."""
    try:
        with open(os.readlink(f"/proc/{pid}/fd/2"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def processes_by_role(tag, wanted="worker"):
    return [p for p in processes_tagged(tag) if role(p) == wanted]


def wait_for_training(tag, count, timeout=180):
    """The pids of `count` workers, once one of them reports a training step (mid-row, past start-up)."""
    def training():
        workers = processes_by_role(tag)
        return len(workers) >= count and any("progress " in log_of(p) for p in workers) and workers
    return wait_for(training, timeout, f"{count} workers training")


@pytest.fixture
def tag(monkeypatch):
    """A tag for the environment of the processes a test starts (in-process launches inherit it too);
    none of them may outlive the test by more than a few seconds."""
    value = f"rosetta-{uuid.uuid4()}"
    monkeypatch.setenv("ROSETTA_TEST_TAG", value)
    yield value
    deadline = time.monotonic() + 5
    while processes_tagged(value) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_tagged(value), "a process of the run outlived it"


@pytest.fixture
def start_compare(tag):
    """Start compare.py in the background, tagged; killed at the end of the test whatever happens."""
    started = []

    def start(*args, cwd=ROOT):
        env = {**os.environ, "ROSETTA_TEST_TAG": tag}
        started.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "compare.py"), *args], cwd=cwd, env=env,
                                        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        return started[-1]
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()   # its workers notice and end themselves (harness.worker.exit_with_parent)
        proc.communicate()


def follow(proc):
    """(stdout, [(time, line)] of stderr) of a compare.py started by start_compare, read as it runs:
    compare.py says on stderr how each row ended, as it ends."""
    err = [(time.monotonic(), line) for line in proc.stderr]
    out = proc.stdout.read()
    proc.wait(timeout=30)
    return out, err
