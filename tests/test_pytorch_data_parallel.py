"""PyTorch's in-process engine, nn.DataParallel, and its step written with the four primitives, on simulated GPUs.

There is no GPU here. The CUDA calls are recorded instead of made (the device count, the module's move to cuda:0,
DataParallel's balance check), and the four primitives are CPU stand-ins that keep their semantics: scatter cuts
dim 0 as torch.chunk does (comm.scatter without chunk sizes), replicate is PyTorch's own with its broadcast made of
differentiable copies (so backward sums the replicas' gradients into the module's parameters, as Broadcast's
backward does), parallel_apply calls each replica on its shard, gather concatenates on the output device. The
tests check the calls (which, on which devices, in which order) and the numbers: one step is the spec's step
(common/optim.py's SGD on the batch's mean gradient: lr / batch x the summed gradient) within TOLERANCE."""
import importlib

import numpy as np
import pytest

from common import RosettaError, optim
from common.lenet import init_weights
from harness.processes.launch import process_per_device, uses_engine
from harness.loader import load_module
from harness.studies.stepcheck import mean_gradient
from conftest import framework_or_skip, scratch

LR = 0.2
# A step's weights, as tests/test_engines.py checks the built-in engines: float32 rounding of the chunked sums is up
# to 1.3e-6 here (measured at one thread: conv1.bias, 97 x 26 x 26 terms per channel that nearly cancel), and a
# convention slip (the loss divided by the per-device batch) moves a step by 2.5e-2.
TOLERANCE = 1e-5


@pytest.fixture
def torch():
    framework_or_skip("pytorch")
    import torch
    return torch


@pytest.fixture
def simulate(torch, monkeypatch):
    """simulate(n): from now on, a machine whose PyTorch sees n CUDA devices; returns the list its GPU calls are
    recorded in, as (call, device index or indices)."""
    from torch import nn
    from torch._utils import _get_device_index
    parallel = {name: importlib.import_module(f"torch.nn.parallel.{name}")
                for name in ("data_parallel", "replicate", "scatter_gather")}
    calls = []

    def index(device):
        return _get_device_index(device, True)

    def to(module, *args, real=nn.Module.to, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "cuda":
            calls.append(("to", index(device)))
            return module   # the CPU holds what the device would
        return real(module, *args, **kwargs)

    def copies(tensors, devices, detach=False):   # Broadcast's outputs: one differentiable copy per device
        return [[t.detach().clone() if detach else t.clone() for t in tensors] for _ in devices]

    def scatter(inputs, target_gpus, dim=0):
        calls.append(("scatter", [index(d) for d in target_gpus]))
        if isinstance(inputs, torch.Tensor):
            return inputs.chunk(len(target_gpus), dim)
        return [tuple(parts) for parts in zip(*(t.chunk(len(target_gpus), dim) for t in inputs))]

    def replicate(network, devices, detach=False, real=parallel["replicate"].replicate):
        calls.append(("replicate", [index(d) for d in devices]))
        return real(network, devices, detach)

    def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
        calls.append(("parallel_apply", [index(d) for d in devices]))
        kwargs_tup = kwargs_tup or [{}] * len(modules)
        return [module(*(x if isinstance(x, (list, tuple)) else (x,)), **kwargs)
                for module, x, kwargs in zip(modules, inputs, kwargs_tup)]

    def gather(outputs, target_device, dim=0):
        calls.append(("gather", index(target_device)))
        return torch.cat(outputs, dim)

    def start(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(nn.Module, "to", to)
        monkeypatch.setattr(parallel["data_parallel"], "_get_available_device_type", lambda: "cuda")
        monkeypatch.setattr(parallel["data_parallel"], "_check_balance",
                            lambda ids: calls.append(("check_balance", list(ids))))
        monkeypatch.setattr(parallel["replicate"], "_broadcast_coalesced_reshape", copies)
        monkeypatch.setattr(parallel["scatter_gather"], "scatter", scatter)   # what DataParallel's scatter_kwargs calls
        for name, stand_in in (("replicate", replicate), ("parallel_apply", parallel_apply), ("gather", gather)):
            monkeypatch.setattr(parallel["data_parallel"], name, stand_in)   # what DataParallel calls
        for name, stand_in in (("scatter", scatter), ("replicate", replicate), ("parallel_apply", parallel_apply),
                               ("gather", gather)):
            monkeypatch.setattr(nn.parallel, name, stand_in)                 # what primitives_step calls
        return calls
    return start


def spec_step(weights, X, y):
    """The spec's step on the batch, and the batch's mean loss: common/optim.py's SGD on the mean gradient of the
    one-device scratch step (harness.studies.stepcheck), as the optimizer tests check every framework."""
    fw = framework_or_skip("pytorch")
    dp = load_module("pytorch", "data_parallel")
    sgd = optim.Optimizer("sgd", lr=LR)
    model, _ = scratch("pytorch")
    want, _ = optim.step(sgd, weights, mean_gradient(fw, model, weights, None, X, y), optim.init_state(sgd, weights))
    (device,) = fw.get_devices(1)
    (loss,), _, _ = dp.loss_and_grads(model, [model.get_params(weights, device)], [None],
                                      dp.split_and_load(X, [device]), dp.split_and_load(y, [device]), [device])
    return want, float(loss) / len(y)


def batch_tensors(torch, X, y):
    """As pipeline.py hands the engine a batch: the images in the model's memory layout."""
    to_layout = load_module("pytorch", "lenet").to_layout
    return to_layout(torch.from_numpy(X)), torch.from_numpy(y)


def assert_spec(got, want, loss, want_loss):
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=TOLERANCE, err_msg=name)
    assert loss == pytest.approx(want_loss, abs=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_steps_are_the_spec_steps_on_simulated_gpus(torch, simulate, monkeypatch, digits, n):
    """97 images: uneven chunks (49, 48; 33, 33, 31). Two steps, each checked from the weights the last one left;
    the module is replicated again in the second."""
    weights = init_weights(3)
    batches = [(digits.X_train[i:i + 97], digits.y_train[i:i + 97]) for i in (0, 97)]
    fw = framework_or_skip("pytorch")
    builtin = load_module("pytorch", "builtin")
    ids = list(range(n))
    for k, (X, y) in enumerate(batches):
        want, want_loss = spec_step(weights, X, y)   # before the simulation: the spec runs on the real CPU
        calls = simulate(4)
        if k == 0:
            devices = fw.get_devices(n)
            assert devices == [torch.device("cuda", i) for i in ids]
            model = builtin.get_model(weights, devices)
            assert isinstance(model.net, torch.nn.DataParallel)
            assert (model.net.device_ids, model.net.output_device) == (ids, 0)
            assert calls == [("to", 0), ("check_balance", ids)]   # the module onto the first device, then wrapped
            assert model.net.src_device_obj == torch.device("cuda", 0)
            model.net.src_device_obj = torch.device("cpu")   # its check that the module is on cuda:0: the stand-in
            calls.clear()
        loss = builtin.train_step(model, batch_tensors(torch, X, y), LR, len(X))
        assert calls == [("scatter", ids), ("replicate", ids), ("parallel_apply", ids), ("gather", 0)]
        calls.clear()
        weights = builtin.to_numpy(model)
        assert_spec(weights, want, loss, want_loss)
        monkeypatch.undo()   # the CPU as it is, for the next spec step


@pytest.mark.parametrize("n", [2, 3])
def test_the_four_primitives_step_is_the_spec_step(torch, simulate, digits, n):
    weights = init_weights(4)
    X, y = digits.X_train[:97], digits.y_train[:97]
    want, want_loss = spec_step(weights, X, y)
    net = load_module("pytorch", "lenet").build_model(weights)   # where devices[0] would hold it
    calls = simulate(n)
    builtin = load_module("pytorch", "builtin")
    devices = framework_or_skip("pytorch").get_devices(n)
    ids = list(range(n))
    loss = builtin.primitives_step(net, *batch_tensors(torch, X, y), devices, LR, len(X))
    assert calls == [("scatter", ids), ("replicate", ids), ("parallel_apply", ids), ("gather", 0)]
    assert_spec(load_module("pytorch", "lenet").to_numpy(list(net.parameters())), want, loss, want_loss)


def test_on_the_cpu_data_parallel_does_nothing_so_the_engine_refuses_it(torch):
    """The reason the CPU's built-in row is DistributedDataParallel: nn.DataParallel without CUDA keeps no device
    and runs the plain module; get_model, outside a process group and without GPUs, says how to start the engine."""
    fw = framework_or_skip("pytorch")
    net = torch.nn.DataParallel(load_module("pytorch", "lenet").build_model(init_weights(0)))
    assert net.device_ids == []
    with pytest.raises(RosettaError, match="DistributedDataParallel, one process per device"):
        load_module("pytorch", "builtin").get_model(init_weights(0), fw.get_devices(2))


def test_the_exec_column_names_data_parallel_on_gpus(torch, simulate):
    from harness.training.loop import Builtin
    fw = framework_or_skip("pytorch")
    simulate(2)
    runner = Builtin(fw, fw.get_devices(2))
    runner.start(init_weights(0), optim.Optimizer())
    assert runner.exec_name() == "eager+DataParallel"


def test_the_exec_column_names_ddp_in_a_process_group(torch, gloo_group):
    """On the CPU: the process group of one that compare.py's worker joins for a 1-device row, here in-process."""
    from harness.training.loop import Builtin
    fw = framework_or_skip("pytorch")
    runner = Builtin(fw, fw.get_devices(1))
    runner.start(init_weights(0), optim.Optimizer())
    assert runner.exec_name() == "eager+DDP"


@pytest.mark.parametrize("visible,processes,world", [("", 1, 2), ("", 2, 2), ("0,4", 1, 1), ("0,4", 2, 2)])
def test_the_built_in_row_runs_in_one_process_only_on_gpus(monkeypatch, visible, processes, world):
    """The one decision (harness.processes.launch.process_per_device), as compare.py plans a row of 2 devices: without GPUs
    DistributedDataParallel, one process per device; with GPUs (here CUDA_VISIBLE_DEVICES=0,4) a one-process row is
    nn.DataParallel, no process group; two processes stay DDP. Other frameworks' rows are as asked."""
    import compare
    from harness.run.plan import run_specs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)   # "": no GPU, whatever the machine has
    args = compare.parse_args(["--frameworks", "pytorch,mxnet", "--mode", "builtin", "--devices", "2",
                               "--processes", str(processes)])
    (pytorch, reason), (mxnet, _) = run_specs(args)
    assert reason is None and (pytorch.devices, pytorch.processes) == (2, world)
    assert uses_engine(pytorch) == (world > 1) and (mxnet.processes, uses_engine(mxnet)) == (processes, processes > 1)
    assert process_per_device("pytorch", "builtin", processes, gpus=["0", "4"] if visible else []) == (world > 1)
    assert not process_per_device("pytorch", "scratch", 1, gpus=[])


def test_cuda_visible_devices_0_4_is_device_ids_0_1(torch, simulate, monkeypatch):
    """The articles' CUDA_VISIBLE_DEVICES=0,4 with device_ids=[0, 1]: CUDA shows the process GPUs 0 and 4 as cuda:0
    and cuda:1. The launcher hands out the physical ids; the placement rule gives a one-process run both visible
    GPUs; get_devices names them cuda:0 and cuda:1, and nn.DataParallel runs on device_ids [0, 1]. Two processes:
    local rank r owns cuda:r, physical GPU 0, then 4."""
    from common.placement import local_devices, machine_gpus, my_gpus, worker_env
    fw = framework_or_skip("pytorch")
    environ = {"CUDA_VISIBLE_DEVICES": "0,4"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,4")
    assert machine_gpus(environ) == ["0", "4"] and not process_per_device("pytorch", "builtin", 1)
    simulate(2)   # what CUDA reports to a process started with CUDA_VISIBLE_DEVICES=0,4
    gpus = my_gpus("pytorch", fw.gpu_count(), 2, 1, environ)
    devices = local_devices(fw, gpus, 2)
    assert gpus == [0, 1] and devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert load_module("pytorch", "builtin").get_model(init_weights(0), devices).net.device_ids == [0, 1]
    for rank in (0, 1):   # compare.py's two workers: torchrun's variables, every GPU left visible
        env = {**environ, **worker_env("pytorch", rank, 2, 1, machine_gpus(environ))}
        assert env["CUDA_VISIBLE_DEVICES"] == "0,4" and env["LOCAL_RANK"] == str(rank)
        assert local_devices(fw, my_gpus("pytorch", 2, 1, 2, env), 1) == [torch.device("cuda", rank)]
