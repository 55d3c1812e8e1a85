"""The suite's shared fixtures are made once: the tests that use them run on one pytest-xdist worker
(tests/worker_groups.py), checked here on a small suite of its own run the way the README runs ours; a worker ends
once its results are sent (tests/worker_exit.py). And the suite's processes leave nothing in the machine's temporary
folder (tests/conftest.py)."""
import os
import re
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import pytest
import sys
sys.path.insert(0, {TESTS!r})
from worker_exit import end_after_sending_results
from worker_groups import keep_together

def pytest_collection_modifyitems(config, items):
    keep_together(config, items, "one-worker", lambda item: "shared" in item.fixturenames)

@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    end_after_sending_results(config)
"""

SUITE = """
import os
import sys

import pytest

@pytest.fixture(scope="session")
def shared():
    return "made once a worker"

@pytest.mark.parametrize("i", range(6))
def test_shared(i, shared):
    pass

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass


class FreedAtTeardown:   # as a framework's objects are, by the interpreter's teardown of the modules
    def __init__(self, path):
        self.path = path

    def __del__(self):
        open(self.path, "w").close()


def test_one_that_a_teardown_would_free(worker_id):
    import types
    module = sys.modules["freed_at_teardown"] = types.ModuleType("freed_at_teardown")
    module.held = FreedAtTeardown(os.path.join(os.environ["TEARDOWN_MARKS"], worker_id))
"""


@pytest.mark.slow   # a pytest of two worker processes
def test_a_shared_fixture_s_tests_run_on_one_worker_and_each_worker_ends_once_it_has_reported(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = \"--dist loadgroup\"\n")
    marks = tmp_path / "teardown"
    marks.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TEARDOWN_MARKS": str(marks)})
    assert done.returncode == 0, done.stdout[-2000:]
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED test_suite.py::(test_\w+)\[(\d)\](@one-worker)?", done.stdout)
    assert len(ran) == 12, done.stdout[-2000:]
    shared = {(worker, suffix) for worker, name, _, suffix in ran if name == "test_shared"}
    assert len(shared) == 1 and shared.pop()[1] == "@one-worker", ran   # one worker, named with the group
    # every result came back, and the worker that held the object ended before its interpreter's teardown freed it
    assert "13 passed" in done.stdout and os.listdir(marks) == [], (os.listdir(marks), done.stdout[-2000:])


def test_what_the_suite_s_processes_put_in_the_temporary_folder_is_the_session_s():
    """torchrun's logs, Chromium's profiles and TensorFlow's generated sources (removed only by a process that exits
    through atexit) go to the session's folder, which its first process removes as it ends; they were left in /tmp."""
    session = os.environ["ROSETTA_TEST_TMPDIR"]
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == session and os.path.basename(session).startswith("rosetta-tests-"), session
