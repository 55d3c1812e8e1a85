"""Every execution level computes the same step on several devices as eagerly, run as a user runs it; every
execution.py swaps the same units of its data_parallel.py, and an imported data_parallel.py already runs the
default level."""
import importlib.util
import json
import os

import pytest

from conftest import ROOT, framework_or_skip, run_compare
from harness.loader import load_module

UNITS = ("forward", "update", "loss_and_grads", "step_on_shards")


def test_every_framework_swaps_the_same_units(fw):
    data_parallel, execution = load_module(fw.name, "data_parallel"), load_module(fw.name, "execution")
    assert tuple(data_parallel.UNITS) == UNITS
    assert set(execution.COMPILERS) == set(execution.NAMES)
    assert all(set(compilers) <= set(UNITS) for compilers in execution.COMPILERS.values())


def test_data_parallel_starts_at_the_default_level(fw):
    """The units a fresh data_parallel.py compiles at import are the ones execution.use('default') compiles."""
    data_parallel, execution = load_module(fw.name, "data_parallel"), load_module(fw.name, "execution")
    spec = importlib.util.spec_from_file_location(f"rosetta_{fw.name}.fresh_data_parallel",
                                                  os.path.join(ROOT, fw.name, "data_parallel.py"))
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    execution.use("default")
    compiled = {name for name, written in data_parallel.UNITS.items() if getattr(data_parallel, name) is not written}
    assert {name for name, written in fresh.UNITS.items() if getattr(fresh, name) is not written} == compiled
    assert compiled == set(execution.COMPILERS[execution.DEFAULT])


@pytest.mark.slow
def test_xla_on_two_devices_is_an_ok_row_with_the_eager_step(tmp_path):
    """XLA compiles each device's part of the step: one XLA cluster cannot reach another device's
    variables (it used to fail with "Trying to access resource ... located in device CPU:1")."""
    framework_or_skip("tensorflow")
    out = tmp_path / "xla.json"
    proc = run_compare("--frameworks", "tensorflow", "--exec", "eager,xla", "--devices", "2", "--epochs", "1",
                       "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    eager, xla = json.loads(out.read_text())["runs"]
    assert (eager["exec"], xla["exec"]) == ("eager", "tf.function+XLA")
    assert (xla["devices"], xla["status"]) == (2, "ok")
    assert xla["replica_spread"] == 0.0
    assert xla["step_losses"] == pytest.approx(eager["step_losses"], abs=1e-5)
