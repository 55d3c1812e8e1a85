"""Where a step of several devices goes (harness/split.py): the parts add up to the step, the compute is the scaling
efficiency's share, and in every framework the all-reduce alone is the row's own pattern of collectives and sums."""
import re

import numpy as np
import pytest

from common import FRAMEWORKS
from conftest import framework_or_skip
from harness.loader import load_module
from harness.spec import RunSpec
from harness.split import add_split, format_split, measure


def row(**changes):
    return {"status": "ok", "framework": "pytorch", "mode": "scratch", "exec": "eager", "devices": 2, "processes": 2,
            "cores": "per-device", "threads": 1,
            "batch_size": 256, "images_per_second": 2000.0, "scaling_efficiency": 0.8, "epoch_seconds_median": 10.0,
            "input_seconds_median": 0.5, "allreduce_alone_seconds": 0.01, "allreduce_alone_pattern": "bucketed",
            **changes}


def test_the_parts_add_up_to_the_step_and_the_compute_is_the_scaling_share():
    r, unmeasured, unscaled = row(), row(allreduce_alone_seconds=None), row(scaling_efficiency=None)
    add_split([r, unmeasured, unscaled])
    s = r["step_split"]
    assert s["step"] == pytest.approx(256 / 2000)                    # 128 ms a global batch
    assert s["compute"] == pytest.approx(0.8 * 0.128)                # its 1-device rate's time for these images
    assert s["allreduce"] == 0.01 and s["input"] == pytest.approx(0.05 * 0.128)   # 5% of the epoch, per step
    assert s["rest"] == pytest.approx(0.128 - 0.1024 - 0.01 - 0.0064)
    assert "step_split" not in unmeasured and "step_split" not in unscaled
    table = format_split([r, unmeasured])
    assert table.count("\n") == 2   # the heading, its rule, one row
    assert "| 128.0 | 102.4 (80%) | 10.0 (8%) | 6.4 (5%) | 9.2 (7%) | 0.80 |" in table
    assert "| pytorch | 1 per device | scratch (eager), bucketed all-reduce, 2 devices, 2 processes |" in table
    assert format_split([unmeasured]) == ""


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_allreduce_alone_is_the_row_s_pattern_and_sums(name, monkeypatch):
    """In one process over 2 devices (the worker's task, called directly): the scratch row's --allreduce, the built-in
    engine's declared pattern; an all-reduce that does not sum is refused, not timed."""
    fw = framework_or_skip(name)
    devices = fw.get_devices(2)
    for mode, allreduce in (("scratch", "per-tensor"), ("scratch", "bucketed"), ("builtin", "per-tensor")):
        spec = RunSpec(name, mode=mode, allreduce=allreduce, devices=2, dataset="synthetic")
        result = measure(fw, spec, 0, 1, devices)
        expected = allreduce if mode == "scratch" else load_module(name, "builtin").ALLREDUCE
        assert result["allreduce"] == expected and result["repeats"] == 20 and 0 < result["min"] <= result["median"]
    data_parallel = load_module(name, "data_parallel")
    monkeypatch.setattr(data_parallel, "allreduce_gradients", lambda grads, bucket_bytes=None: grads)   # sums nothing
    with pytest.raises(RuntimeError, match="summed to 1.0, not 2"):
        measure(fw, RunSpec(name, devices=2, dataset="synthetic"), 0, 1, devices)


def test_jax_s_compiled_builtin_step_all_reduces_each_parameter_alone():
    """What jax/builtin.py's ALLREDUCE says: XLA's CPU compiler keeps one all-reduce per gradient (not combined)."""
    framework_or_skip("jax")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from common.lenet import PARAM_SHAPES, init_weights
    builtin = load_module("jax", "builtin")
    net, step, mesh = builtin.get_model(init_weights(0), jax.devices()[:2])
    rows = NamedSharding(mesh, P("devices"))
    X, y, mask = (jax.device_put(a, rows) for a in (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int32),
                                                     np.ones(8, np.float32)))
    hlo = step.lower(net, X, y, mask, jnp.float32(0.1)).compile().as_text()
    reductions = re.findall(r"= f32\[[\d,]*\]\{[\d,]*\} all-reduce\(", hlo)
    assert builtin.ALLREDUCE == "per-tensor" and len(reductions) == len(PARAM_SHAPES) == 8
