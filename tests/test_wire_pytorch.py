"""PyTorch's bf16 on the wire in its built-in engine, what tests/test_precision.py does not see: DistributedDataParallel
with a communication hook (pytorch/builtin.py's bf16_hook). On NCCL it is torch's own bf16_compress_hook; on gloo DDP
refuses that function by its name (a torch build without CUDA and NCCL 2.10+), so the engine registers bf16_on_gloo,
the same steps. The tests: the hook's gradients are the fp32 ones rounded to bf16 (a process group of one: the sum is
the one tensor) and the update is the recipe's on them; bf16_on_gloo is torch's hook to the bit; the GPU path chooses
torch's own (recorded, no GPU here); two processes end with the scratch step's bf16 weights to the bit."""
import numpy as np
import pytest

from common import models
from common.interface import Network, Unavailable
from common.precision import is_representable, rounded
from conftest import framework_or_skip
from harness.loader import load_module
from harness.processes.launch import run_workers

LR, BATCH = 0.1, 16
NAMES = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight",
         "fc2.bias")   # the LeNet's parameters, in the module's order


@pytest.fixture(scope="module")
def builtin(pt):
    return load_module("pytorch", "builtin")


def step_recording_gradients(torch, builtin, model, digits):
    """One train_step of `model` on the first BATCH digits; returns the gradients the optimizer received (after DDP's
    all-reduce, before the update) and the weights before and after the step."""
    to_layout = load_module("pytorch", "lenet").to_layout
    seen, step = {}, model.mixed.step

    def record(optimizer):
        seen.update(zip(NAMES, (p.grad.detach().clone().numpy() for p in model.net.module.parameters())))
        return step(optimizer)
    model.mixed.step = record
    before = builtin.to_numpy(model)
    X, y = digits.X_train[:BATCH], digits.y_train[:BATCH]
    builtin.train_step(model, (to_layout(torch.tensor(X)), torch.tensor(y)), LR, len(X))
    return seen, before, builtin.to_numpy(model)


def test_ddp_s_bf16_hook_rounds_the_gradients_to_bf16(pt, torch, builtin, digits, gloo_group):
    """DDP in a gloo group of this one process, fp32 network: with allreduce_dtype='bf16' every gradient the
    optimizer receives is the fp32 engine's gradient rounded to bf16, to the bit (the hook's cast; the division by a
    world of 1 and the sum of one tensor change nothing), and fp32's are not bf16 values (so the cast is the hook's).
    The update is the recipe's, lr / batch times the rounded sum: the engine's loss convention holds with the hook."""
    weights = models.init_weights("lenet", 0)
    grads, stepped = {}, {}
    for dtype in ("fp32", "bf16"):
        model = builtin.get_model(weights, pt.get_devices(1), allreduce_dtype=dtype)
        grads[dtype], before, stepped[dtype] = step_recording_gradients(torch, builtin, model, digits)
    assert set(grads["bf16"]) == set(NAMES)
    assert not all(is_representable(g, "bf16") for g in grads["fp32"].values())
    for name in NAMES:
        np.testing.assert_array_equal(grads["bf16"][name], rounded(grads["fp32"][name], "bf16").astype(np.float32),
                                      err_msg=name)
        want = torch.from_numpy(before[name]).add_(torch.from_numpy(grads["bf16"][name]), alpha=-LR / BATCH)
        np.testing.assert_array_equal(stepped["bf16"][name], want.numpy(), err_msg=name)   # SGD: lr * world / batch


def test_bf16_on_gloo_is_torch_s_bf16_compress_hook(torch, builtin, gloo_group):
    """The engine's hook against torch's own on the same bucket, in a gloo group (world 1: torch's hook runs here when
    called directly; only DDP's registration refuses it): the same bf16 values widened into the bucket's buffer, to
    the bit, and fp32 values that were not bf16's before."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    class Bucket:   # what a hook reads of a dist.GradBucket
        def __init__(self, values):
            self.values = values

        def buffer(self):
            return self.values
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    ours, theirs = Bucket(values.clone()), Bucket(values.clone())
    got = builtin.bf16_on_gloo(None, ours).wait()
    want = bf16_compress_hook(None, theirs).wait()
    assert got.dtype == want.dtype == torch.float32
    assert got.data_ptr() == ours.buffer().data_ptr()   # decompressed in place, as torch's
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(got, values.to(torch.bfloat16).float()) and not torch.equal(got, values)


def test_ddp_refuses_torch_s_bf16_hook_on_this_build(torch, builtin, gloo_group):
    """Why the engine has a hook of its own: DDP refuses bf16_compress_hook by its name where torch has no CUDA and
    NCCL 2.10+ (this CPU build), whatever the group's backend."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch accepts bf16_compress_hook")
    model = builtin.get_model(models.init_weights("lenet", 0), framework_or_skip("pytorch").get_devices(1))
    with pytest.raises(TypeError, match="BF16 all reduce communication hook required CUDA 11"):
        model.net.register_comm_hook(None, bf16_compress_hook)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_engine_chooses_its_hook_by_the_group_s_backend(pt, torch, builtin, gloo_group, monkeypatch, backend):
    """get_model(..., allreduce_dtype='bf16') registers torch's own bf16_compress_hook where the group is NCCL's (a GPU
    run; the backend reported as nccl, the registration recorded instead of made) and bf16_on_gloo on gloo's; with
    'fp32' no hook (DDP's own fp32 all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel
    calls = []
    monkeypatch.setattr(builtin.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(DistributedDataParallel, "register_comm_hook",
                        lambda self, state, hook: calls.append((state, hook)))
    weights = models.init_weights("lenet", 0)
    builtin.get_model(weights, pt.get_devices(1), allreduce_dtype="bf16")
    assert calls == [(None, bf16_compress_hook if backend == "nccl" else builtin.bf16_on_gloo)]
    calls.clear()
    builtin.get_model(weights, pt.get_devices(1))
    assert calls == []


def test_data_parallel_refuses_bf16_on_the_wire(torch, builtin):
    """nn.DataParallel (GPUs, one process) sums its replicas' gradients in their backward, with no hook: the row is
    skipped with the reason, before anything reaches a GPU (there is none here)."""
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(Unavailable, match="nn.DataParallel"):
        builtin.get_model(models.init_weights("lenet", 0), devices, network=Network(), allreduce_dtype="bf16")


# ------------------------------------------------------------------------------ across processes
SPEC = {"framework": "pytorch", "dataset": "digits", "epochs": 1, "batch_size": 97, "lr": 0.2, "seed": 5,
        "threads": 1, "max_steps": 2, "devices": 2}


def trained(tmp_path, mode, processes, allreduce_dtype):
    """(results in rank order, the final weights) of SPEC's two steps in `mode` on 2 devices in `processes` workers."""
    out = tmp_path / f"{mode}-{processes}p-{allreduce_dtype}.npz"
    results = run_workers({**SPEC, "mode": mode, "processes": processes, "allreduce_dtype": allreduce_dtype,
                           "weights_out": str(out)}, timeout=300)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    assert len({r["digest"] for r in results}) == 1, "processes hold different weights"
    return results, dict(np.load(out))


@pytest.mark.slow   # starts worker processes
def test_two_ddp_processes_take_the_scratch_step_s_bf16_steps(pt, tmp_path):
    """DDP in 2 gloo processes with bf16 on the wire: both end with the same weights, and they are the in-process
    2-device scratch step's with bf16 on the wire to the bit (the hook divides by 2 before the bf16 sum, exactly, and
    the update multiplies by 2 again), as are the scratch step's in 2 processes (gloo's bf16 all_reduce); not the fp32
    wire's weights, and the second step's loss moves off fp32's (the setting reached the all-reduce)."""
    engine, weights = trained(tmp_path, "builtin", 2, "bf16")
    for mode, processes in (("scratch", 1), ("scratch", 2)):
        _, scratch = trained(tmp_path, mode, processes, "bf16")
        for name, value in scratch.items():
            np.testing.assert_array_equal(weights[name], value, err_msg=f"{mode}, {processes} process(es): {name}")
    fp32, fp32_weights = trained(tmp_path, "builtin", 2, "fp32")
    assert any(not np.array_equal(fp32_weights[name], value) for name, value in weights.items())
    assert engine[0]["step_loss_sums"][0] == fp32[0]["step_loss_sums"][0]   # the same first step
    assert engine[0]["step_loss_sums"][1] != fp32[0]["step_loss_sums"][1]
