"""PyTorch's --precision fp16, what tests/test_loss_scaling.py does not see: that each mode really computes in fp16
(DDP's gradients before unscaling are fp16 values, not bf16 ones), that a step the scaler skips leaves torch.optim's
state and the schedule where they were (the canonical state's one step count stays Adam's and the scheduler's), that
accumulating moves the scale once per update, and that a new scale compiles nothing."""
import numpy as np
import pytest

from common import models
from common.interface import Network, StepSettings
from common.loss_scaling import LossScaling, Scaler
from common.optim import Optimizer
from common.precision import is_representable
from harness.loader import load_module

LR, BATCH = 0.1, 16
LOW_OPS = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight",
           "fc2.bias")   # every LeNet parameter feeds a convolution or a dense layer, which autocast runs low


def batch(digits, n=BATCH, start=0):
    return digits.X_train[start:start + n], digits.y_train[start:start + n]


def lenet_network(precision, scaling=None):
    return Network("lenet", None, False, precision, scaling)


# ------------------------------------------------------------------------------ what the step computes in
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_ddp_s_gradients_are_the_precision_s_values_before_unscaling(pt, torch, precision, digits, gloo_group):
    """DistributedDataParallel (a group of this one process, so its average is the sum) under torch.autocast: every
    gradient scaler.step receives, still scaled, is a value of the precision widened to fp32, because the cast's
    backward rounds it there. fp16's are not all bf16 values (so it is not bf16 that ran), and fp32's not all fp16."""
    builtin, lenet = load_module("pytorch", "builtin"), load_module("pytorch", "lenet")
    scaling = LossScaling(2.0 ** 10) if precision == "fp16" else None
    model = builtin.get_model(models.init_weights("lenet", 0), pt.get_devices(1), network=lenet_network(precision,
                                                                                                          scaling))
    seen, step = {}, model.mixed.step

    def record(optimizer):
        seen.update(zip(LOW_OPS, (p.grad.detach().clone().numpy() for p in model.net.module.parameters())))
        return step(optimizer)
    model.mixed.step = record
    X, y = batch(digits)
    builtin.train_step(model, (lenet.to_layout(torch.tensor(X)), torch.tensor(y)), LR, len(X))
    assert set(seen) == set(LOW_OPS) and all(np.all(np.isfinite(g)) and np.any(g) for g in seen.values())
    if precision == "fp32":
        assert not all(is_representable(g, "fp16") for g in seen.values())
        return
    assert all(is_representable(g, precision) for g in seen.values()), precision
    if precision == "fp16":
        assert not all(is_representable(g, "bf16") for g in seen.values())
        assert builtin.scaler_state(model).scale == 2.0 ** 10


def test_the_scratch_step_s_convolutions_run_in_fp16(pt, torch, digits):
    """lenet.autocast at fp16: the network's convolutions and dense layers give fp16 (the CPU's autocast takes fp16
    in torch 2.13), and the loss is fp32."""
    lenet = load_module("pytorch", "lenet")
    params = lenet.get_params(models.init_weights("lenet", 0), pt.get_devices(1)[0])
    X, y = batch(digits)
    with lenet.autocast(torch.device("cpu"), "fp16"):
        conv = torch.nn.functional.conv2d(lenet.to_layout(torch.tensor(X)), params[0], params[1])
        logits = lenet.forward(params, lenet.to_layout(torch.tensor(X)))
    assert (conv.dtype, logits.dtype) == (torch.float16, torch.float16)
    assert lenet.loss_sum(logits, torch.tensor(y)).dtype == torch.float32


# ------------------------------------------------------------------------------ a skipped step changes no state
OVERFLOWING = LossScaling(2.0 ** 40, 2)   # a scale at which the fp16 backward overflows for certain
ADAM = Optimizer("adam", lr=1e-3, schedule="cosine", warmup_steps=2, total_steps=6)


@pytest.mark.parametrize("mode", ["idiomatic", "builtin"])
def test_an_engine_s_skipped_step_moves_neither_adam_nor_its_schedule(pt, torch, mode, digits, request):
    """torch.optim's Adam under the GradScaler: an overflowing step leaves the weights, Adam's buffers and step
    count and the scheduler's count (the rate) as they were, and halves the scale; the next, finite, step is the
    first update: the canonical state says step 1, which Adam and the scheduler agree on."""
    if mode == "builtin":
        request.getfixturevalue("gloo_group")
    engine, lenet = load_module("pytorch", mode), load_module("pytorch", "lenet")
    weights = models.init_weights("lenet", 0)
    model = engine.get_model(weights, pt.get_devices(1), ADAM, network=lenet_network("fp16", OVERFLOWING))
    X, y = batch(digits)
    step = {"idiomatic": lambda: engine.train_step(model, X, y, pt.get_devices(1), ADAM.lr),
            "builtin": lambda: engine.train_step(model, (lenet.to_layout(torch.tensor(X)), torch.tensor(y)), ADAM.lr,
                                                 len(X))}[mode]
    rate = model.trainer.optimizer.param_groups[0]["lr"]
    step()
    assert engine.scaler_state(model).scale == 2.0 ** 39
    assert model.trainer.optimizer.state_dict()["state"] == {} and model.trainer.scheduler.last_epoch == 0
    assert model.trainer.optimizer.param_groups[0]["lr"] == rate
    for name, w in engine.to_numpy(model).items():
        np.testing.assert_array_equal(w, weights[name])
    model.mixed.update(2.0 ** 8)   # GradScaler's own way to set the scale: the next step's backward is finite
    step()
    assert engine.optimizer_state(model)["step"] == 1 and engine.scaler_state(model).scale == 2.0 ** 8
    assert model.trainer.optimizer.param_groups[0]["lr"] != rate


def test_the_scratch_step_s_skipped_step_keeps_the_state_but_not_the_running_statistics(pt, digits):
    """optimizer.apply's state (Adam's buffers and step) and the weights stay as they were when the scaler finds an
    overflow, on every replica; the ResNet's running statistics are the forward's, as every framework's scaler keeps
    them."""
    optimizer = load_module("pytorch", "optimizer")
    devices = pt.get_devices(2)
    state = models.init_bn_state("resnet18", 8)
    model = load_module("pytorch", "resnet").Functional(precision="fp16")
    weights = models.init_weights("resnet18", 0, width=8)
    replicas = [model.get_params(weights, d) for d in devices]
    bn_states = [model.get_bn_state(state, d) for d in devices]
    states = [optimizer.init_state(r, ADAM) for r in replicas]
    scaler = Scaler(OVERFLOWING)
    X, y = batch(digits, 4)   # PyTorch's CPU convolution backward in fp16 is slow (~30 times fp32's here)
    loss = pt.train_step(model, replicas, bn_states, X, y, devices, ADAM.lr, states=states,
                         settings=StepSettings(scaler=scaler))
    assert np.isfinite(loss) and scaler.scale == 2.0 ** 39
    for replica, replica_state, bn_state in zip(replicas, states, bn_states):
        for name, w in model.to_numpy(replica).items():
            np.testing.assert_array_equal(w, weights[name])
        assert replica_state["step"] == 0 and all(not b.any() for slot in ADAM.slots for b in replica_state[slot])
        assert any(np.any(v != state[n]) for n, v in model.bn_state_to_numpy(bn_state).items())


# ------------------------------------------------------------------------------ accumulation and compilation
MODES = {"scratch": 2, "idiomatic": 1, "builtin": 1}


@pytest.mark.parametrize("mode", MODES)
def test_accumulating_scales_every_micro_batch_alike_and_moves_the_scale_once_per_update(pt, mode, digits, request):
    """--accumulate 4 at fp16, the scale doubling after every finite step: after 2 steps it is 4 times the first (not
    4**4: one scale update per step, and GradScaler refuses a second unscale_ before it), and each step's loss is the
    unaccumulated step's within fp16's noise."""
    from harness.spec import RunSpec
    from harness.training.loop import runner as runner_for, train
    if mode == "builtin":
        request.getfixturevalue("gloo_group")
    losses, scales = {}, {}
    for k in (1, 4):
        spec = RunSpec(framework="pytorch", mode=mode, devices=MODES[mode], accumulate=k, precision="fp16",
                       loss_scale=2.0 ** 4, loss_scale_interval=1, batch_size=16, epochs=1, max_steps=2, lr=LR)
        runner = runner_for(spec, pt, pt.get_devices(MODES[mode]))
        record = train(runner, digits, spec, Optimizer(lr=LR))
        losses[k] = [s / n for s, n in zip(record["step_loss_sums"], record["step_sizes"])]
        scales[k] = runner.loss_scale()
    assert scales[4] == scales[1] == 2.0 ** 6
    assert losses[4] == pytest.approx(losses[1], rel=1e-3)


@pytest.mark.slow   # torch.compile's first step: seconds
def test_the_compiled_step_takes_a_new_scale_without_compiling_again(pt, torch, digits):
    """The graph level compiles the forward only; the scale multiplies the loss outside it and reaches the compiled
    backward as its incoming gradient: a step at another scale runs the same graphs (recompiling would raise)."""
    model = load_module("pytorch", "lenet").Functional(precision="fp16")
    units = load_module("pytorch", "execution").compile("graph", model)
    devices = pt.get_devices(2)
    replicas = [model.get_params(models.init_weights("lenet", 0), d) for d in devices]
    scaler = Scaler(LossScaling(2.0 ** 4, 1))
    X, y = batch(digits, 32)
    pt.train_step(model, replicas, [None, None], X, y, devices, LR, settings=StepSettings(units=units, scaler=scaler))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            pt.train_step(model, replicas, [None, None], X, y, devices, LR,
                          settings=StepSettings(units=units, scaler=scaler))
    assert scaler.scale == 2.0 ** 7
