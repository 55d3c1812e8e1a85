"""--allreduce-dtype bf16 across processes, in the scratch step: two processes of a device each sum in bf16 exactly as
two devices of one process do (MXNet through the kvstore's fp32 sum of two bf16 values rounded once, which is one
bf16 addition; TensorFlow through the collective, which takes bf16 tensors on the CPU; JAX through its process-mesh
sum, which XLA's CPU promotes to fp32 between converts: one addition, rounded once), and the setting crosses the
processes (the weights are not the fp32 wire's). PyTorch's (gloo) and DDP's: tests/test_wire_pytorch.py."""
import numpy as np
import pytest

from conftest import framework_or_skip
from harness.processes.launch import run_workers
from harness.spec import RunSpec
from harness.training.loop import steps_per_epoch

SPEC = {"mode": "scratch", "dataset": "digits", "epochs": 1, "batch_size": 97, "lr": 0.2, "seed": 5, "threads": 1,
        "max_steps": 2}


def trained(tmp_path, framework, devices, processes, allreduce_dtype, allreduce="per-tensor"):
    """(results in rank order, the final weights) of SPEC's steps on `devices` in `processes` workers."""
    out = tmp_path / f"{framework}-{devices}d-{processes}p-{allreduce_dtype}-{allreduce}.npz"
    results = run_workers({**SPEC, "framework": framework, "devices": devices, "processes": processes,
                           "allreduce": allreduce, "allreduce_dtype": allreduce_dtype, "weights_out": str(out)},
                          timeout=400)
    return results, (dict(np.load(out)) if out.exists() else None)


@pytest.mark.slow   # starts real worker processes (MXNet's: a scheduler and a server too)
@pytest.mark.parametrize("framework", ["mxnet", "tensorflow", "jax"])
@pytest.mark.parametrize("allreduce", ["per-tensor", "bucketed"])
def test_two_processes_sum_in_bf16_as_two_devices_do(tmp_path, framework, allreduce, digits, recipe_runs):
    """Bit for bit the one process's weights; and those are not the fp32 wire's: the same steps in this process with
    fp32 on the wire move a weight by far more than the suite's fp32 tolerance (3.8e-4 in the largest, measured in
    all six cases; another thread count's round-off is below 1e-6)."""
    framework_or_skip(framework)
    _, in_process = trained(tmp_path, framework, 2, 1, "bf16", allreduce)
    results, across = trained(tmp_path, framework, 2, 2, "bf16", allreduce)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    assert len({r["digest"] for r in results}) == 1, "processes hold different weights"
    for name, value in in_process.items():
        np.testing.assert_array_equal(across[name], value, err_msg=name)
    fp32 = RunSpec(**{**SPEC, "framework": framework, "devices": 2, "allreduce": allreduce, "allreduce_dtype": "fp32"})
    per_epoch = steps_per_epoch(len(digits.y_train), SPEC["batch_size"], 2)
    fp32_weights, _, _ = recipe_runs(fp32, fp32.canonical_optimizer(per_epoch))
    moved = max(np.max(np.abs(fp32_weights[name] - value)) for name, value in in_process.items())
    assert moved > 1e-5, moved


@pytest.mark.slow
def test_mxnet_refuses_three_processes_in_one_line(tmp_path):
    """Past two processes MXNet's kvstore would add three fp32 values before the one rounding: every worker skips the
    row with the reason, and the job ends."""
    framework_or_skip("mxnet")
    results, _ = trained(tmp_path, "mxnet", 3, 3, "bf16")
    assert [r["status"] for r in results] == ["skipped"] * 3, results[0].get("error")
    assert "only two processes" in results[0]["error"] and "\n" not in results[0]["error"]
