"""Every execution level computes the same step on several devices as eagerly, run as a user runs it; every
execution.py compiles the same units of its data_parallel.py and hands them to the step (set on no module), and
steps configured differently run one after the other in one process."""
import json

import numpy as np
import pytest

from conftest import framework_or_skip, replicas_of, run_compare, scratch, train_steps, weights_of
from harness.loader import load_module

UNITS = ("update", "loss_and_grads", "step_on_shards")


def test_every_framework_compiles_the_same_units(fw):
    """The recipe's three units in every data_parallel.py, in order (JAX's adds its optimizer's update, which jax.jit
    compiles too); each level compiles some of them."""
    data_parallel, execution = load_module(fw.name, "data_parallel"), load_module(fw.name, "execution")
    assert tuple(unit for unit in data_parallel.UNITS if unit in UNITS) == UNITS
    assert set(execution.COMPILERS) == set(execution.NAMES)
    assert all(set(compilers) <= set(data_parallel.UNITS) for compilers in execution.COMPILERS.values())


@pytest.mark.parametrize("network", ["lenet", "resnet"])
def test_compile_returns_every_unit_as_its_level_makes_it_and_sets_nothing(fw, network):
    """execution.compile(level, model) hands back every unit: the ones COMPILERS names at that level compiled for
    this network, the rest as written; the modules keep the functions as written (nothing is swapped into them)."""
    data_parallel, execution = load_module(fw.name, "data_parallel"), load_module(fw.name, "execution")
    before = {name: getattr(data_parallel, name) for name in UNITS}
    model, _ = scratch(fw.name, network)
    for level in execution.NAMES:
        units = execution.compile(level, model)
        assert set(units) == set(data_parallel.UNITS), level
        compiled = {name for name in units if units[name] is not data_parallel.UNITS[name]}
        assert compiled == set(execution.COMPILERS[level]), level
    assert {name: getattr(data_parallel, name) for name in UNITS} == before == {
        name: data_parallel.UNITS[name] for name in UNITS}


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


def test_steps_configured_differently_run_one_after_the_other_with_no_reset(fw, digits):
    """The settings are the step's arguments, never a module's globals: a default LeNet step, then steps of another
    layout, exec level and all-reduce, then a ResNet step with synchronised BatchNorm, then the first configuration
    again, which gives its first result bit for bit (nothing the others did stayed behind)."""
    from common import resnet
    from common.lenet import init_weights
    execution = load_module(fw.name, "execution")
    devices = fw.get_devices(2)
    X, y = digits.X_train[:61], digits.y_train[:61]

    def lenet_step(**configuration):
        replicas = replicas_of(fw, init_weights(0), devices, **configuration)
        loss = train_steps(fw, replicas, X, y, devices, 0.2, **configuration)
        return loss, weights_of(fw, replicas[1], **configuration)

    first_loss, first = lenet_step()
    other_layout = next(layout for layout in execution.LAYOUTS if layout != execution.DEFAULT_LAYOUT) \
        if len(execution.LAYOUTS) > 1 else execution.DEFAULT_LAYOUT
    loss, weights = lenet_step(layout=other_layout, level="eager", bucket_bytes=4096)
    assert loss == pytest.approx(first_loss, abs=1e-5)
    model, _ = scratch(fw.name, "resnet", sync=True)
    replicas = [model.get_params(resnet.init_weights(0, 4), d) for d in devices]
    bn_states = [model.get_bn_state(resnet.init_bn_state(4), d) for d in devices]
    train_steps(fw, replicas, X[:7], y[:7], devices, 0.1, bn_states=bn_states, network="resnet", sync=True)
    again_loss, again = lenet_step()
    assert again_loss == first_loss
    for name, value in first.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
