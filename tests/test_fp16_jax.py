"""--precision fp16 in JAX beyond the contract (tests/test_loss_scaling.py): the step really computes in fp16, its
fp16 gradients are the reference's to fp16's precision, its convolutions sum in fp32 (XLA's CPU may sum an fp16 one in
fp16), a new loss scale compiles nothing in any mode, and a skipped step leaves the optimizer's state
(Adam's step count and moments) and the weights as they were, while the running statistics its forward made stay."""
import functools
import re

import numpy as np
import pytest

from common import backprop, models, optim as common_optim, precision
from common.interface import Network
from common.loss_scaling import LossScaling
from common.precision import BOUND, GRADIENT_BOUND
from conftest import framework_or_skip, scratch
from harness.loader import load_module

SCALE = 2.0 ** 12   # the LeNet's 16 images: their fp16 backward overflows at 2**13, not here (test_loss_scaling.py)
MODE_DEVICES = {"scratch": 2, "builtin": 2, "idiomatic": 1}


@pytest.fixture(scope="module")
def jax_fw():
    return framework_or_skip("jax")


def total_error(grads, want):
    diff = sum(np.sum((np.asarray(grads[n], np.float64) - want[n]) ** 2) for n in want)
    return float(np.sqrt(diff / sum(np.sum(np.square(want[n], dtype=np.float64)) for n in want)))


def test_one_device_s_fp16_gradients_are_the_reference_s_and_fp16_values(jax_fw, digits):
    """The compiled scratch loss_and_grads at fp16 and a loss scale: the loss unscaled and within BOUND of the
    reference's, the gradients of the scaled loss within GRADIENT_BOUND of the reference's (measured: the loss 6e-6
    off, the gradients 1.5e-4 in norm: the fp32 sums' order rounds a few near-ties to the other fp16 neighbour) and
    every one an fp16 value widened to fp32; the loss left fp32's."""
    X, y = digits.X_train[:16], digits.y_train[:16]
    weights = models.init_weights("lenet", 0)
    want_loss, want, _ = backprop.loss_and_grads("lenet", weights, None, X, y, "fp16", SCALE)
    fp32_loss = backprop.loss_and_grads("lenet", weights, None, X, y, "fp32")[0]
    model, settings = scratch("jax", precision="fp16")
    device = jax_fw.get_devices(1)[0]
    losses, grads, _ = settings.units["loss_and_grads"](
        model, [model.get_params(weights, device)], [None], jax_fw.split_and_load(X, [device]),
        jax_fw.split_and_load(y, [device]), [device], np.float32(SCALE))
    loss, got = float(losses[0]), model.to_numpy(grads[0])
    assert abs(loss - want_loss) <= BOUND["fp16"] * abs(want_loss), (loss, want_loss)
    assert abs(loss - fp32_loss) > BOUND["fp32"] * abs(fp32_loss)
    assert total_error(got, want) <= GRADIENT_BOUND["fp16"]
    assert all(precision.is_representable(got[n], "fp16") for n in got)


# A convolution the program asks XLA for in fp16 (the lowered StableHLO: what XLA's CPU makes of it differs by CPU)
FP16_CONVOLUTION = re.compile(r"stablehlo\.convolution\(.*-> tensor<[\dx]*xf16>")


def test_fp16_convolutions_sum_in_fp32_whatever_xla_s_cpu_does(jax_fw, digits):
    """XLA's CPU may run an fp16 convolution in fp16, rounding as it sums: on an Intel Xeon with AVX512-FP16 most
    outputs came out a rounding off the fp32 sum's; an AMD EPYC (Zen 4, no AVX512-FP16) widens it to fp32 and rounds
    once, as both do for bf16 (docs/profiling.md). What the code guarantees on either: lenet.widened_conv is the fp32
    sum rounded once, in both low precisions; the scratch step's program at fp16, its backward (the input
    gradient written as an fp32 convolution of the fp16 values: lenet.accumulated_conv_backward) as its forward, has
    no convolution typed fp16; Flax's fp16 convolutions are given widened_conv (flax_conv), its bf16 ones XLA's own."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((16, 12, 12, 20)), 0.3 * rng.standard_normal((5, 5, 20, 50))
    dims = ("NHWC", "HWIO", "NHWC")

    def conv(h, w):
        return lax.conv_general_dilated(h, w, (1, 1), "VALID", dimension_numbers=dims)
    lenet = load_module("jax", "lenet")
    for dtype in (jnp.bfloat16, jnp.float16):
        low_h, low_w = jnp.asarray(h, dtype), jnp.asarray(w, dtype)
        once = conv(low_h.astype(jnp.float32), low_w.astype(jnp.float32)).astype(dtype)
        widened = functools.partial(lenet.widened_conv, window_strides=(1, 1), padding="VALID", dimension_numbers=dims)
        assert np.array_equal(widened(low_h, low_w), once), dtype
        assert not FP16_CONVOLUTION.search(jax.jit(widened).lower(low_h, low_w).as_text())
    assert FP16_CONVOLUTION.search(jax.jit(conv).lower(low_h, low_w).as_text())   # the check sees one where it is
    assert lenet.flax_conv("fp16")["conv_general_dilated"] is lenet.widened_conv and "conv_general_dilated" not in \
        lenet.flax_conv("bf16")
    params = lenet.get_params(models.init_weights("lenet", 0), jax_fw.get_devices(1)[0])
    X, y = jnp.asarray(digits.X_train[:16]), jnp.asarray(digits.y_train[:16])
    step = jax.jit(jax.grad(lambda p: lenet.scaled_loss(p, X, y, jnp.float32(SCALE), precision="fp16")[0]))
    program = step.lower(params).as_text()
    assert "xf16>" in program and not FP16_CONVOLUTION.search(program)


def test_the_flax_modules_compute_in_fp16_on_fp32_parameters(jax_fw):
    """The engines' networks (the idiomatic LeNet, the ResNet of both engines) built with Flax's dtype=fp16: their
    convolutions and dense layers give fp16, their BatchNorm too (its statistics fp32), their parameters stay fp32."""
    import jax.numpy as jnp
    lenet, resnet = load_module("jax", "lenet"), load_module("jax", "resnet")
    net = lenet.build_model(models.init_weights("lenet", 0), "fp16")
    X = jnp.zeros((2, 1, 28, 28), jnp.float32)
    assert net.conv1(X.transpose(0, 2, 3, 1)).dtype == jnp.float16 and net(X).dtype == jnp.float16
    assert {p.value.dtype for _, p in net.layers()} == {jnp.dtype(jnp.float32)}
    res = resnet.build_model(models.init_weights("resnet18", 0, width=8), models.init_bn_state("resnet18", 8),
                             precision="fp16")
    h = res.conv(X.transpose(0, 2, 3, 1))
    assert h.dtype == res.bn(h).dtype == jnp.float16
    assert res.bn.mean.value.dtype == res.conv.kernel.value.dtype == jnp.float32


def runner_of(jax_fw, mode, network):
    from harness.training.loop import MODES, Scratch, functional
    from common.interface import StepSettings
    devices = jax_fw.get_devices(MODE_DEVICES[mode])
    if mode != "scratch":
        return MODES[mode](jax_fw, devices, network)
    model = functional(jax_fw, network)
    return Scratch(jax_fw, devices, network, model, StepSettings(units=load_module("jax", "execution").compile(
        "default", model)))


def run(runner, digits, mode, steps, optimizer, model="lenet", hook=None):
    from harness.spec import RunSpec
    from harness.training.loop import Hooks, train
    devices = MODE_DEVICES[mode]
    spec = RunSpec(framework="jax", model=model, mode=mode, devices=devices, batch_size=16 * devices, epochs=1,
                   max_steps=steps, lr=optimizer.lr, precision="fp16")
    return train(runner, digits, spec, optimizer, hooks=Hooks(before_step=hook))


@pytest.mark.parametrize("mode", MODE_DEVICES)
def test_a_new_loss_scale_compiles_nothing(jax_fw, digits, mode):
    """The scale is a traced argument of every compiled step: growing after every finite step (interval 1) and
    halving at each overflow, the LeNet's scale changes at every step, and after the second step no program is
    compiled again (the idiomatic step compiles twice at any precision: its first outputs are committed to the device,
    its first inputs were not, and jax.jit keys on that)."""
    import jax
    from jax._src import monitoring
    runner = runner_of(jax_fw, mode, Network("lenet", None, False, "fp16", LossScaling(SCALE, 1)))
    compiles, seen = [], []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        run(runner, digits, mode, 6, common_optim.Optimizer(lr=0.1),
            hook=lambda step, r: seen.append((r.loss_scale(), len(compiles))))
    finally:
        monitoring._unregister_event_duration_listener_by_callback(count)
    scales = [s for s, _ in seen]
    assert all(a != b for a, b in zip(scales, scales[1:])), scales
    assert seen[2][1] == seen[-1][1], seen


@pytest.mark.parametrize("mode", MODE_DEVICES)
def test_a_skipped_step_keeps_the_weights_and_adam_s_state(jax_fw, digits, mode):
    """At a scale past fp16's range every gradient overflows: the step is skipped, the weights and Adam's state (its
    step count and moments) as they were, the scale halved."""
    runner = runner_of(jax_fw, mode, Network("lenet", None, False, "fp16", LossScaling(2.0 ** 40, 2000)))
    before = []
    run(runner, digits, mode, 1, common_optim.Optimizer("adam", lr=0.01),
        hook=lambda step, r: before.append(r.weights()))
    after, state = runner.weights(), runner.optimizer_state()
    assert all(np.array_equal(after[n], before[0][n]) for n in after)
    assert state["step"] == 0 and all(not np.any(a) for key, a in state.items() if key != "step")
    assert runner.loss_scale() == 2.0 ** 39


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODE_DEVICES)
def test_a_skipped_resnet_step_keeps_the_running_statistics_its_forward_made(jax_fw, digits, mode):
    """As every framework's scaler: the forward of a skipped step has run, and its BatchNorm statistics stay."""
    state = models.init_bn_state("resnet18", 8)
    runner = runner_of(jax_fw, mode, Network("resnet18", state, False, "fp16", LossScaling(2.0 ** 40, 2000)))
    before = []
    run(runner, digits, mode, 1, common_optim.Optimizer(lr=0.1), "resnet18",
        hook=lambda step, r: before.append(r.weights()))
    after = runner.weights()
    assert all(np.array_equal(after[n], before[0][n]) for n in after)
    assert not np.array_equal(runner.bn_state()["stem.bn.running_mean"], state["stem.bn.running_mean"])
