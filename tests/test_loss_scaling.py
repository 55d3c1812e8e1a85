"""--precision fp16's dynamic loss scaling (common/loss_scaling.py): the rule, every framework's own scaler against it,
and a forced overflow in every framework and mode: the step skipped (no weight moves), the scale halved, then grown
again after its interval, step for step as the numpy reference's step (common/backprop.py with the scale) does it."""
import dataclasses
import math

import numpy as np
import pytest

from common import backprop, models, optim as common_optim
from common.interface import Network, RosettaError, StepSettings, Unavailable
from common.loss_scaling import FRAMEWORK_DEFAULTS, LossScaling, Scaler, ScalerState, scales, unscaled
from common.precision import BOUND, GRADIENT_BOUND
from common.sharding import shard_bounds
from conftest import framework_or_skip

LR, STEPS, INTERVAL = 0.1, 6, 2
# The ResNet's case in 4 steps, the fewest that skip, halve, then grow after INTERVAL finite steps: its steps and
# their numpy references are the slow part (PyTorch's fp16 convolutions on a CPU: 2.7 s a step).
NETWORK_STEPS = {"lenet": STEPS, "resnet": 4}
PER_DEVICE = 16   # images a device: the fp16 backward overflows at the initial scale, not at half of it (by 18% or more)
# The ResNet on 16 images a device is ill-conditioned: a channel whose batch variance is near zero amplifies rounding,
# so fp32 gradients (PyTorch's and MXNet's alike, 1e-6 apart) are 2e-3 from float64's in norm (4e-6 on 64 images),
# fp16's up to 7e-2: its gradients are compared on 64 images, in tests/test_precision.py.
MARGIN = 1.18     # a scale this much above or below the one a step ran at overflows the same: the case is not borderline


# ------------------------------------------------------------------------------------------------ the rule
def test_an_overflow_skips_the_step_and_halves_the_scale_which_grows_after_its_interval():
    assert scales(LossScaling(8.0, 2), [False, True, True, True, False, True]) == [8, 4, 4, 8, 8, 4]
    scaler = Scaler(LossScaling(8.0, 3))
    assert [scaler.update(f) for f in (True, True, False, True)] == [True, True, False, True]
    assert (scaler.scale, scaler.good_steps) == (4.0, 1)   # the overflow started the count again


def test_a_late_scaler_runs_the_step_after_an_overflow_at_the_same_scale():
    """MXNet's LossScaler: the scale a check decides reaches the forward one step later, and the next decision starts
    from it, not from the scale the step ran at."""
    assert scales(LossScaling(8.0, 2, late=True), [False, False, True, True, True, False, True]) == [8, 8, 4, 2, 2, 4, 4]
    assert scales(LossScaling(8.0, 1, maximum=16.0), [True] * 4) == [8, 16, 16, 16]


def test_unscaling_is_exact_and_finds_a_non_finite_gradient():
    grads, finite = unscaled({"a": np.float32([3 * 2.0 ** 20, 1.0])}, 2.0 ** 20)
    assert finite and grads["a"].tolist() == [3.0, 2.0 ** -20]
    assert not unscaled({"a": np.float32([np.inf]), "b": np.float32([1.0])}, 2.0)[1]


# ----------------------------------------------------------------------------------- a forced overflow, every mode
def reference_step(name, weights, state, X, y, devices, scale, precision):
    """The step of common/backprop.py at `scale` from `weights` on `devices` shards: the mean loss, whether the
    unscaled summed gradients are all finite (None where the verdict is borderline: it changes within MARGIN of the
    scale, so a framework's rounding may decide it either way; an inf pixel decides it at any scale), and the SGD
    update's movement of every weight (None where it skips)."""
    total, grads, verdicts = 0.0, None, {factor: True for factor in (1 / MARGIN, MARGIN)}
    for a, b in shard_bounds(len(X), devices):
        for factor in verdicts:   # every shard's gradients finite, at each of the two scales
            g = backprop.loss_and_grads(name, weights, state, X[a:b], y[a:b], precision, scale * factor)[1]
            verdicts[factor] = verdicts[factor] and unscaled(g, 1.0)[1]
        loss, g, _ = backprop.loss_and_grads(name, weights, state, X[a:b], y[a:b], precision, scale)
        total += loss
        grads = g if grads is None else {n: grads[n] + g[n] for n in g}
    grads, finite = unscaled(grads, scale)
    moved = {n: -LR / len(X) * g.astype(np.float64) for n, g in grads.items()} if finite else None
    decided = not np.all(np.isfinite(X)) or set(verdicts.values()) == {finite}
    return total / len(X), finite if decided else None, moved


def forced_overflow_case(fw, network, devices, rows=None):
    """(data, precision, initial scale): fp16 where the framework computes it here, its backward overflowing at the
    initial scale; MXNet, whose fp16 kernels are cuDNN's, at fp32 with the first batch's first image made inf. The
    data: the digits, or their first `rows` training images."""
    from common.data import load_dataset
    data = load_dataset("digits")
    if rows is not None:
        data = dataclasses.replace(data, X_train=data.X_train[:rows], y_train=data.y_train[:rows])
    if fw.name != "mxnet":
        return data, "fp16", 2.0 ** 13 if network == "lenet" else 2.0 ** 10
    first = first_rows(data, devices)[0][0]
    X = data.X_train.copy()
    X[first, 0, 0, 0] = np.inf
    return dataclasses.replace(data, X_train=X), "fp32", 2.0 ** 14


def first_rows(data, devices, steps=STEPS):
    from common.batches import Order
    order = Order(len(data.y_train), PER_DEVICE * devices, 0, devices)
    return [rows for rows, _ in order.parts(0, 0, 1)[:steps]]


def make_runner(fw, mode, devices, network):
    from harness.loader import load_module
    from harness.training.loop import MODES, Scratch, functional
    if mode != "scratch":
        return MODES[mode](fw, devices, network)
    model = functional(fw, network)
    return Scratch(fw, devices, network, model, StepSettings(units=load_module(fw.name, "execution").compile(
        "default", model)))


MODE_DEVICES = {"scratch": 2, "builtin": 2, "idiomatic": 1}


# The fast tier proves the scratch step's LeNet in every framework; the engines' and the ResNet's cases run in the
# slow tier, and the ResNet's in the scratch step only (an engine's scaler is the same with either network).
CASES = [("scratch", "lenet"), pytest.param("builtin", "lenet", marks=pytest.mark.slow),
         pytest.param("idiomatic", "lenet", marks=pytest.mark.slow), pytest.param("scratch", "resnet", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mode,network", CASES)
def test_a_forced_overflow_skips_the_step_halves_the_scale_and_grows_it_again(fw, mode, network, request):
    """Six steps (the ResNet's four) from a scale at which the backward overflows, the scale doubling after 2 finite
    steps. Step by step, from the weights the framework holds before it: the step skips exactly where the numpy
    reference's step from those weights at that scale overflows (the weights unchanged, to the bit), and updates where
    it does not, moving the weights (the LeNet's) as the reference's update does within GRADIENT_BOUND; its loss within
    BOUND. (Where the reference's verdict changes within 18% of the scale, either is right; the first step's never
    does.) The scales follow the rule (common/loss_scaling.py; MXNet's engines its late variant): halved at each
    overflow, doubled after 2 finite steps, and the run both skips and grows. (Six steps compared against one reference
    run would compare chaos: at fp16 and lr 0.1 the reference's own losses move 3e-3 when its weights move 1e-6 of
    themselves, its ResNet's 2e-2.)"""
    from harness.spec import RunSpec
    from harness.training.loop import Hooks, train
    devices_n = MODE_DEVICES[mode]
    if fw.name == "pytorch" and mode == "builtin":   # DDP runs a process per device: one here, in its own group
        request.getfixturevalue("gloo_group")
        devices_n = 1
    data, level, initial = forced_overflow_case(fw, network, devices_n)
    name = "lenet" if network == "lenet" else "resnet18"
    state = models.init_bn_state(name, 8)
    runner = make_runner(fw, mode, fw.get_devices(devices_n), Network(name, state, False, level,
                                                                      LossScaling(initial, INTERVAL)))
    seen = []
    spec = RunSpec(framework=fw.name, model=name, mode=mode, devices=devices_n, batch_size=PER_DEVICE * devices_n,
                   epochs=1, max_steps=NETWORK_STEPS[network], lr=LR, precision=level)
    record = train(runner, data, spec, common_optim.Optimizer(lr=LR),
                   hooks=Hooks(before_step=lambda step, r: seen.append((r.loss_scale(), r.weights()))))
    seen.append((runner.loss_scale(), runner.weights()))
    losses = [s / n for s, n in zip(record["step_loss_sums"], record["step_sizes"])]
    updated = []
    for step, rows in enumerate(first_rows(data, devices_n, NETWORK_STEPS[network])):
        (scale, before), after = seen[step], seen[step + 1][1]
        loss, finite, want = reference_step(name, before, state, data.X_train[rows], data.y_train[rows], devices_n,
                                            scale, level)
        moved = {n: after[n].astype(np.float64) - before[n] for n in before}
        updated.append(any(np.any(m != 0) for m in moved.values()))
        assert finite is not None or step > 0, "the first step's overflow is borderline: choose another case"
        assert updated[-1] == finite or finite is None, (step, scale)
        if updated[-1] and want is not None:
            if network == "lenet":   # the ResNet's gradients: tests/test_precision.py, on 64 images (see CONDITIONING)
                assert total_error(moved, want) <= GRADIENT_BOUND[level], (step, total_error(moved, want))
            assert abs(losses[step] - loss) <= BOUND[level] * abs(loss), (step, losses[step], loss)
    late = fw.name == "mxnet" and mode != "scratch"
    assert [s for s, _ in seen[:-1]] == scales(LossScaling(initial, INTERVAL, late=late), updated)
    steps = [(a, b) for (a, _), (b, _) in zip(seen, seen[1:])]
    assert not updated[0] and any(b < a for a, b in steps) and any(b > a for a, b in steps)   # halved, grown again


RESUMED = [("scratch", "lenet"), pytest.param("builtin", "lenet", marks=pytest.mark.slow),
           pytest.param("idiomatic", "lenet", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mode,network", RESUMED)
def test_a_run_resumed_at_fp16_carries_on_at_the_scale_and_count_it_stopped_at(fw, mode, network, tmp_path, request):
    """Two epochs with momentum and a cosine schedule, from a scale at which the backward overflows, the scale
    doubling after 2 finite steps: epoch 1 skips a step and ends where a fresh scaler would not start. A skipped
    step moves no schedule: the scratch step's rate is the schedule's at the updates that ran (the engines' own
    optimizers count them). The run resumed from its epoch-1 checkpoint takes epoch 2's steps at the uninterrupted
    run's scales and rates and ends with its weights and scaler, bit for bit (a scaler started afresh would grow
    later, a schedule counting the skipped steps would run ahead: both diverge). The checkpoint's optimizer state has
    counted only the updates that ran: the resume accepts it. (MXNet's: fp32 with an inf pixel,
    forced_overflow_case; its spec is fp32, so its scaler is read from the file here.)"""
    from harness.spec import RunSpec
    from harness.training.checkpoints import checkpoint_name, read_scaler, resume_point, saver
    from harness.training.loop import Hooks, Start, steps_per_epoch, train
    devices_n = MODE_DEVICES[mode]
    if fw.name == "pytorch" and mode == "builtin":
        request.getfixturevalue("gloo_group")
        devices_n = 1
    steps = 6 if fw.name == "mxnet" else 5   # an epoch's: each then ends away from the first scale
    data, level, initial = forced_overflow_case(fw, network, devices_n, PER_DEVICE * devices_n * steps)
    network = Network("lenet", None, False, level, LossScaling(initial, INTERVAL))
    spec = RunSpec(framework=fw.name, mode=mode, devices=devices_n, batch_size=PER_DEVICE * devices_n, epochs=2,
                   lr=LR, optimizer="momentum", lr_schedule="cosine", precision=level, loss_scale=initial,
                   loss_scale_interval=INTERVAL, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    per_epoch = steps_per_epoch(len(data.y_train), spec.batch_size, devices_n)
    optimizer = spec.canonical_optimizer(per_epoch)

    def trained(start):
        runner, scales, rates = make_runner(fw, mode, fw.get_devices(devices_n), network), [], []
        step = runner.step
        runner.step = lambda batch, lr, size: rates.append(lr) or step(batch, lr, size)   # the rate the loop gives
        record = train(runner, data, spec, optimizer, start=start, hooks=Hooks(
            before_step=lambda step, r: scales.append(r.loss_scale()), after_epoch=saver(spec, 0, optimizer, per_epoch)))
        return (record["step_loss_sums"][-per_epoch:], scales[-per_epoch:], runner.weights(), runner.scaler_state(),
                scales + [runner.loss_scale()], rates)

    whole = trained(Start())
    if mode == "scratch":   # a skipped step (its scale backed off) leaves the schedule where it was
        skipped = [after < before for before, after in zip(whole[4], whole[4][1:])]
        updates = np.cumsum([0] + [not s for s in skipped[:-1]])
        assert any(skipped) and whole[5] == [optimizer.learning_rate(u) for u in updates]
    path = str(tmp_path / checkpoint_name(spec, 1))
    scaler, steps = read_scaler(fw.name, path)
    assert steps == per_epoch and scaler != ScalerState(initial, initial, 0), scaler   # a fresh scaler differs
    weights, _, state, restored, epoch = resume_point(spec.replace(resume_from=path), optimizer, per_epoch)
    assert state["step"] < steps and epoch == 1   # an update skipped: the optimizer counted one step fewer
    assert restored == (scaler if level == "fp16" else None)
    again = trained(Start(weights, state, epoch, scaler))
    assert again[1] == whole[1] and again[3] == whole[3]   # every step at the same scale, and the scaler after
    np.testing.assert_array_equal(again[0], whole[0])   # the same losses (a skipped step's may be nan)
    if mode == "scratch":   # an engine's own optimizer sets its rate
        assert again[5] == whole[5][-per_epoch:]
    for name, value in whole[2].items():
        np.testing.assert_array_equal(again[2][name], value, err_msg=name)


def test_the_loss_scaler_beside_a_checkpoint_converts_with_it_and_a_bad_one_is_one_line(tmp_path):
    """The converter copies fp16's loss scaler to the target framework's checkpoint (a run resumed there carries on at
    its scale and count, and accepts an optimizer count short by the skipped steps); a truncated or negative one is
    one line naming the file, when converting and when resuming."""
    from harness.spec import RunSpec
    from harness.training.checkpoints import read_scaler, resume_point, scaler_path, write_scaler, write_weights
    from harness.training.convert import main as convert
    framework_or_skip("pytorch"), framework_or_skip("jax")
    src, dst = str(tmp_path / "lenet-epoch1.pt"), str(tmp_path / "lenet-epoch1.orbax")
    write_weights("pytorch", models.init_weights("lenet", 0), src)
    write_scaler("pytorch", ScalerState(2.0 ** 12, 2.0 ** 12, 3), 7, src)
    assert convert([src, dst]) == 0
    assert read_scaler("jax", dst) == (ScalerState(2.0 ** 12, 2.0 ** 12, 3), 7)
    spec = RunSpec("jax", precision="fp16", resume_from=dst)
    assert resume_point(spec, common_optim.Optimizer(), 7)[3] == ScalerState(2.0 ** 12, 2.0 ** 12, 3)
    with pytest.raises(RosettaError, match="taken 7 steps, not the 1 epochs x 5 steps"):
        resume_point(spec, common_optim.Optimizer(), 5)   # another batch size
    for bad in ('{"scale": 4096.0, "decided"', '{"scale": -1.0, "decided": 1.0, "good_steps": 0, "steps": 7}'):
        with open(scaler_path("pytorch", src), "w") as f:
            f.write(bad)
        with pytest.raises(RosettaError, match="lenet-epoch1.loss-scale.json: .*loss scaler") as err:
            resume_point(RunSpec("pytorch", precision="fp16", resume_from=src), common_optim.Optimizer(), 7)
        assert "\n" not in str(err.value)
        assert convert([src, str(tmp_path / "again-epoch1.orbax")]) == 1


def total_error(moved, want):
    """The movement's distance from the reference's, all weights at once, relative to the reference's."""
    diff = sum(np.sum((moved[n] - want[n]) ** 2) for n in want)
    return math.sqrt(diff / sum(np.sum(want[n] ** 2) for n in want))


def test_mxnet_refuses_fp16_on_the_cpu_in_one_line():
    """MXNet 1.9.1's fp16 convolution and dense layer exist only under cuDNN: asked for fp16 on a CPU, every mode
    says so (a skipped row), never a traceback from inside the kernel."""
    from harness.training.loop import functional
    fw = framework_or_skip("mxnet")
    network = Network("lenet", None, False, "fp16", LossScaling())
    with pytest.raises(Unavailable, match="fp16") as err:
        functional(fw, network)
    assert "\n" not in str(err.value)
    for mode in ("builtin", "idiomatic"):
        runner = make_runner(fw, mode, fw.get_devices(1), network)
        with pytest.raises(Unavailable, match="fp16"):
            runner.start(models.init_weights("lenet", 0), common_optim.Optimizer())


def test_every_framework_s_scaler_as_it_comes_is_the_rule_with_its_defaults():
    """Each framework's own scaler, driven by hand through finite and overflowing gradients, gives the scales
    FRAMEWORK_DEFAULTS says it gives (the run passes its own initial scale and interval over these)."""
    finite = [False, True, True, False, True, True, True]
    interval = 2
    for name, (_, config, _) in FRAMEWORK_DEFAULTS.items():
        if name == "jax":
            continue   # no scaler of its own: the step is the rule (the test above)
        fw = framework_or_skip(name)
        fw.get_devices()   # TensorFlow's logical devices are made before it runs anything
        got = STOCK_SCALERS[name](fw, finite, interval)
        assert got == scales(config._replace(growth_interval=interval), finite), name


def stock_pytorch(fw, finite, interval):
    import torch
    scaler = torch.amp.GradScaler("cpu", growth_interval=interval)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    out = []
    for ok in finite:
        out.append(scaler.get_scale())
        opt.zero_grad()
        scaler.scale((param * (1.0 if ok else float("inf"))).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return out


def stock_tensorflow(fw, finite, interval):
    import keras
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=interval)
    var = keras.Variable([0.0])
    optimizer.build([var])
    out = []
    for ok in finite:
        out.append(float(optimizer.dynamic_scale.numpy()))
        optimizer.apply([keras.ops.convert_to_tensor([1.0 if ok else float("inf")])], [var])
    return out


def stock_mxnet(fw, finite, interval):
    import mxnet as mx
    from mxnet.contrib.amp.loss_scaler import LossScaler
    scaler = LossScaler()
    scaler._scale_seq_len = interval   # the interval has no argument: init_trainer makes it with 2000
    param = mx.gluon.Parameter("w", shape=(1,))
    param.initialize(ctx=mx.cpu())
    out = []
    for ok in finite:
        out.append(scaler.loss_scale)
        param.grad()[:] = 1.0 if ok else np.inf
        scaler.has_overflow([param])
    return out


STOCK_SCALERS = {"pytorch": stock_pytorch, "tensorflow": stock_tensorflow, "mxnet": stock_mxnet}
