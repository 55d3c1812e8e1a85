"""MXNet's bf16 on the wire across processes. Its kvstore's server refuses bf16 arrays ("Unknown type enum 12"), so the
scratch step's processes send their bf16 sums widened to fp32 and round the kvstore's sum to bf16
(mxnet/data_parallel.py, across_processes): with two processes that is the one bf16 addition, and the step is the
in-process bf16 step to the bit; with three the server's fp32 additions would skip a rounding, and the row is refused
in one line. Inside one process the casts and the sums are amp_cast's and elemwise_add's: mshadow's bf16_t (astype,
`+`) truncates, and the sums would be off by a bf16 step where it does."""
import numpy as np
import pytest

from common import precision
from conftest import framework_or_skip
from harness.loader import load_module
from harness.processes.launch import run_workers

SPEC = {"framework": "mxnet", "mode": "scratch", "dataset": "digits", "epochs": 1, "batch_size": 97, "lr": 0.2,
        "seed": 5, "threads": 1, "max_steps": 2}


def trained(tmp_path, devices, processes, allreduce_dtype, allreduce="per-tensor"):
    """(results in rank order, the final weights) of SPEC's steps on `devices` in `processes` workers."""
    out = tmp_path / f"{devices}d-{processes}p-{allreduce_dtype}-{allreduce}.npz"
    results = run_workers({**SPEC, "devices": devices, "processes": processes, "allreduce": allreduce,
                           "allreduce_dtype": allreduce_dtype, "weights_out": str(out)}, timeout=240)
    return results, (dict(np.load(out)) if out.exists() else None)


@pytest.mark.slow   # starts real worker processes, a scheduler and a server
@pytest.mark.parametrize("allreduce", ["per-tensor", "bucketed"])
def test_two_processes_sum_in_bf16_as_two_contexts_do(tmp_path, allreduce):
    """2 processes of a context each, bf16 on the wire: the weights after two steps are the in-process 2-context bf16
    step's to the bit (the kvstore's fp32 sum of two bf16 values, rounded, is elemwise_add's bf16 sum), and not the
    fp32 wire's (the setting crossed the processes)."""
    framework_or_skip("mxnet")
    _, in_process = trained(tmp_path, 2, 1, "bf16", allreduce)
    results, across = trained(tmp_path, 2, 2, "bf16", allreduce)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    assert len({r["digest"] for r in results}) == 1, "processes hold different weights"
    for name, value in in_process.items():
        np.testing.assert_array_equal(across[name], value, err_msg=name)
    _, fp32 = trained(tmp_path, 2, 1, "fp32", allreduce)
    assert any(not np.array_equal(fp32[name], value) for name, value in in_process.items())


@pytest.mark.slow
def test_three_processes_are_refused_in_one_line(tmp_path):
    """Past two processes the kvstore would add three fp32 values before the one rounding: every worker skips the row
    with the reason, and the job ends."""
    framework_or_skip("mxnet")
    results, _ = trained(tmp_path, 3, 3, "bf16")
    assert [r["status"] for r in results] == ["skipped"] * 3, results[0].get("error")
    assert "only two processes" in results[0]["error"] and "\n" not in results[0]["error"]


@pytest.mark.parametrize("op", ["astype", "+"])
def test_mxnet_s_truncating_bf16_ops_would_miss_the_wire_s_sum(op):
    """Why on_the_wire casts with amp_cast and adds with elemwise_add: astype (Cast) and `+` (broadcast_add) on bf16
    keep a float's upper 16 bits, and a tenth of random sums come out a bf16 step off summed_on_the_wire's."""
    framework_or_skip("mxnet")
    from mxnet import nd
    bf16 = load_module("mxnet", "lenet").DTYPES["bf16"]
    a, b = np.random.default_rng(0).standard_normal((2, 10_000)).astype(np.float32)
    want = precision.summed_on_the_wire([a, b], "bf16")
    A, B = nd.array(a), nd.array(b)
    if op == "astype":
        got = nd.elemwise_add(A.astype(bf16), B.astype(bf16))
    else:
        got = nd.amp_cast(A, dtype=bf16) + nd.amp_cast(B, dtype=bf16)
    assert np.mean(nd.amp_cast(got, dtype=np.float32).asnumpy() != want) > 0.1
    exact = nd.elemwise_add(nd.amp_cast(A, dtype=bf16), nd.amp_cast(B, dtype=bf16))
    np.testing.assert_array_equal(nd.amp_cast(exact, dtype=np.float32).asnumpy(), want)
