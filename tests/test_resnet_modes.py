"""The ResNet in each framework's own engines, in this process: the idiomatic loop (one device) and the built-in
engine (two devices of one process; PyTorch's needs a process group: tests/test_resnet_engines.py) compute the
recipe's step with BatchNorm, local or synchronised, and keep the replicas' running statistics as the recipe does.
The recipe's step is the reference (tests/test_resnet_training.py proves it against the spec)."""
import numpy as np
import pytest

from common import FRAMEWORKS
from conftest import framework_or_skip
from common.optim import Optimizer
from harness.spec import RunSpec
from harness.training.loop import runner, train

pytestmark = pytest.mark.slow   # each framework's engines built and stepped in this process: compilation dominates

WIDTH, BATCH, SEED, LR = 8, 97, 5, 0.1   # 97 rows: shards of 49 and 48, so padding and uneven counts show
TOL = 1e-3   # one step of BatchNorm in float32: see tests/test_resnet_engines.py
# MXNet's own BatchNorm op is less precise in float32: its stem gradient is 0.74 off float64's (of 71.7), where the
# recipe's ops are ~0.1 off, so one step moves a weight by up to 1.7e-3. In float64 it is exact (the test below).
ENGINE_TOL = {"mxnet": 3e-3}


def run_spec(framework, mode, devices, bn, **options):
    return RunSpec(framework=framework, model="resnet18", width=WIDTH, bn=bn, mode=mode, devices=devices,
                   dataset="digits", epochs=1, batch_size=BATCH, lr=LR, seed=SEED, threads=1, max_steps=1, **options)


def one_step(framework, mode, devices, bn, digits, optimizer=None, **options):
    """(weights, the replicas' BatchNorm states, the record) after one step of `mode` on `devices` devices."""
    fw = framework_or_skip(framework)
    spec = run_spec(framework, mode, devices, bn, **options)
    run = runner(spec, fw, fw.get_devices(devices))
    record = train(run, digits, spec, optimizer or Optimizer(lr=LR))
    return run.weights(), run.replica_bn_states(), record


@pytest.fixture
def reference(recipe_runs):
    """The recipe's first step on `devices` devices: shared for the session (tests/test_resnet_engines.py's
    reference on one device is the same run)."""
    def get(framework, devices, bn):
        return recipe_runs(run_spec(framework, "scratch", devices, bn), Optimizer(lr=LR))
    return get


def assert_weights(got, want, what, tol=TOL):
    for name, value in want.items():
        err = np.max(np.abs(got[name] - value) / np.maximum(1.0, np.abs(value)))
        assert err <= tol, f"{what}: {name} off by {err:.1e}"


def assert_running_means(got, want, what):
    """The running means (every framework's momentum gives the recipe's; the running variances follow each
    framework's own bias convention: common.resnet.engine_convention)."""
    for name, value in want.items():
        if name.endswith("running_mean"):
            np.testing.assert_allclose(got[name], value, atol=1e-4, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_idiomatic_loop_is_the_recipe_on_one_device(framework, digits, reference):
    weights, states, record = one_step(framework, "idiomatic", 1, "local", digits)
    want_weights, want_states, want_record = reference(framework, 1, "local")
    assert_weights(weights, want_weights, f"{framework} idiomatic", ENGINE_TOL.get(framework, TOL))
    assert len(states) == 1
    assert_running_means(states[0], want_states[0], f"{framework} idiomatic")
    assert record["step_loss_sums"] == pytest.approx(want_record["step_loss_sums"], rel=1e-4)


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "pytorch"])   # DDP: a process per device
def test_the_built_in_engine_is_the_recipe_with_local_batchnorm(framework, digits, reference):
    """Each replica normalises its own shard by its own statistics, and keeps its own running statistics."""
    weights, states, record = one_step(framework, "builtin", 2, "local", digits)
    want_weights, want_states, want_record = reference(framework, 2, "local")
    assert_weights(weights, want_weights, f"{framework} builtin local", ENGINE_TOL.get(framework, TOL))
    assert len(states) == 2
    for got, want in zip(states, want_states):
        assert_running_means(got, want, f"{framework} builtin local")
    assert not np.allclose(states[0]["stem.bn.running_mean"], states[1]["stem.bn.running_mean"])
    assert record["step_loss_sums"] == pytest.approx(want_record["step_loss_sums"], rel=1e-4)


# Gluon's SyncBatchNorm: in a worker (tests/test_resnet_engines.py), whose hang a timeout can end; in this process a
# hang inside MXNet's engine would hold the suite (no Python signal handler runs while it waits).
@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f not in ("pytorch", "mxnet")])
def test_the_built_in_engine_is_one_device_with_synchronised_batchnorm(framework, digits, reference):
    """The whole batch's statistics on every replica: one device's step, and the same running statistics."""
    weights, states, _ = one_step(framework, "builtin", 2, "sync", digits)
    want_weights, want_states, _ = reference(framework, 1, "local")
    assert_weights(weights, want_weights, f"{framework} builtin sync", ENGINE_TOL.get(framework, TOL))
    assert len(states) == 2
    for got in states:
        assert_running_means(got, want_states[0], f"{framework} builtin sync")


def test_gluon_batchnorm_gradients_are_pytorch_s_in_float64(digits):
    """MXNet's looser tolerance is float32 round-off, not a convention: in float64 the Gluon ResNet's gradients
    (nn.BatchNorm's backward) are PyTorch's to 1e-9."""
    from common import models
    from common.resnet import PARAM_NAMES
    from harness.loader import load_module
    framework_or_skip("mxnet"), framework_or_skip("pytorch")
    import torch
    import torch.nn.functional as F
    from mxnet import autograd, gluon, nd
    weights, state = models.init_weights("resnet18", SEED, width=WIDTH), models.init_bn_state("resnet18", WIDTH)
    X, y = digits.X_train[:BATCH], digits.y_train[:BATCH]
    mx_resnet, pt_resnet = load_module("mxnet", "resnet"), load_module("pytorch", "resnet")
    net = mx_resnet.build_model(weights, state)
    net.cast("float64")
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(nd.array(X, dtype="float64")), nd.array(y)).sum()
    loss.backward()
    got = {name: p.grad().asnumpy() for name, p in mx_resnet.gluon_parameters(net).items() if p.grad_req != "null"}
    module = pt_resnet.build_model(weights, state).double()
    F.cross_entropy(module(torch.tensor(X, dtype=torch.float64)), torch.tensor(y), reduction="sum").backward()
    for name, p in zip(PARAM_NAMES, module.parameters()):
        np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=1e-9, atol=1e-9, err_msg=name)


def test_jax_s_synchronised_engine_buckets_and_puts_bf16_on_the_wire(digits, reference):
    """--bn sync with --allreduce bucketed, or --allreduce-dtype bf16: shard_map's step (under jit XLA places the
    all-reduces, where no bucket or cast reaches), its BatchNorm the global batch's (jax/resnet.py's BatchNorm: 49 and
    48 real rows summed, not two means averaged). One device's step and running statistics, the same on both
    replicas; bf16 on the wire moves the weights otherwise than fp32 (bucketed) does."""
    want_weights, want_states, _ = reference("jax", 1, "local")
    got = {}
    for name, option in (("bucketed", {"allreduce": "bucketed"}), ("bf16", {"allreduce_dtype": "bf16"})):
        weights, states, _ = one_step("jax", "builtin", 2, "sync", digits, **option)
        assert_weights(weights, want_weights, f"jax builtin sync {name}")
        assert len(states) == 2 and all(np.array_equal(states[0][n], states[1][n]) for n in states[0])
        assert_running_means(states[0], want_states[0], f"jax builtin sync {name}")
        got[name] = weights
    moved = max(np.max(np.abs(got["bf16"][n] - got["bucketed"][n])) for n in want_weights)
    assert moved > 1e-4, moved   # measured 4.3e-4: bf16's roundings of the summed gradients
