"""Every execution level computes the same step on several devices as eagerly, run as a user runs it."""
import json

import pytest

from conftest import framework_or_skip, run_compare


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
