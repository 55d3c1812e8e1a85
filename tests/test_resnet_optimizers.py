"""Every optimizer on the ResNet, in every mode: the one scratch step with local and synchronised BatchNorm on 2
devices proven step by step against the spec (common/optim.py) as the LeNet's are (tests/test_optimizers.py), and
the idiomatic loop and the in-process built-in engines, with the framework's own optimizer classes, held to the
scratch step; each with a warm-up then a cosine schedule, weight decay and clipping.

The scratch step is checked at every step from the weights the run had before it, with the gradient the run's own
compiled loss_and_grads takes of that batch on the same devices (a local BatchNorm's gradient depends on the split),
the run's gradient to the bit, so the ResNet's chaos (a float32 rounding difference grows ~30x a step) cannot hide or
fake a convention slip, and Adam, which divides a gradient by its own size, cannot turn the rounding of a true zero
gradient (a convolution's bias before a BatchNorm) into a step of the rate's size: every parameter is compared. A
slip moves a step's weights by 1e-4 or more (the rate inside the momentum buffer, coupled decay in adamw); the
rounding of the same update stays below TOLERANCE."""
import numpy as np
import pytest

from common import optim
from common.interface import FRAMEWORKS
from common.models import init_bn_state
from conftest import framework_or_skip, scratch
from harness.spec import RunSpec
from harness.studies.stepcheck import step_errors, traced

pytestmark = pytest.mark.slow   # ResNet steps on several devices

WIDTH, BATCH, SEED, EPOCHS, STEPS, WARMUP = 4, 32, 0, 1, 4, 2
CLIP = 2.0
DECAY = {"momentum": 5e-4, "nesterov": 5e-4, "adam": 5e-4, "adamw": 5e-2, "sgd": 5e-4}
TOLERANCE = 1e-5

# The scratch step is written once for both networks: momentum (a buffer, the rate outside it) and adamw (two moments,
# decoupled decay on every parameter, BatchNorm's scale and shift too) under both BatchNorms, step by step against
# the spec on the step's own gradient.
SCRATCH = [(bn, name) for bn in ("local", "sync") for name in ("momentum", "adamw")]
# The engines (the built-in engine in-process on 2 devices, the idiomatic loop on 1; PyTorch's DDP needs processes:
# tests/test_resnet_engines.py) run the framework's own BatchNorm, whose float32 backward rounds otherwise than the
# recipe's (MXNet's stem gradient is 0.74 off float64's: tests/test_resnet_modes.py), so their gradient is not the
# scratch step's to 1e-5 and Adam turns a near-zero gradient's rounding into a step of the rate's size. They are
# held to the scratch step with the same optimizer after STEPS_ENGINE steps of momentum, whose update is linear in
# the gradient, at TOL; a decay of 0.05 at rate 0.1 moves BatchNorm's
# scale by 5e-3 a step, so an engine that leaves it out (or decays the running statistics) fails. Their optimizer
# state, read back canonical, must be the scratch step's too: the ResNet's names, its layout, its step count.
ENGINES = [(framework, mode, n) for framework in FRAMEWORKS for mode, n in (("builtin", 2), ("idiomatic", 1))
           if (framework, mode) != ("pytorch", "builtin")]
STEPS_ENGINE, ENGINE_WIDTH, ENGINE_BATCH = 2, 8, 97   # test_resnet_modes.py's network and batch (shards of 49, 48)
# The one-step tolerance of test_resnet_modes.py for MXNet, whose BatchNorm backward rounds the most, for every engine:
# after two steps the momentum buffers (gradients) show the BatchNorm rounding, up to 1.2e-3 in PyTorch's nn.BatchNorm2d.
TOL, STATE_TOL = 3e-3, 0.25


def canonical(name, steps=STEPS, lr=None, weight_decay=None):
    return optim.Optimizer(name, lr or optim.DEFAULT_LR[name] / 2, 0.9, DECAY[name] if weight_decay is None
                           else weight_decay, "cosine", min(WARMUP, steps - 1), steps, CLIP)


def run(runners, framework, mode, n_devices, bn, optimizer, digits, steps, width=WIDTH, batch=BATCH):
    """(the framework, the runner, the weights before every step and after the last). `runners`: the session's
    (conftest.scratch_runners), so runs of one scratch configuration with other optimizers share its compilation."""
    fw = framework_or_skip(framework)
    spec = RunSpec(framework, "resnet18", width=width, bn=bn, mode=mode, devices=n_devices, batch_size=batch)
    runner = runners(spec)
    trace, _ = traced(runner, digits, EPOCHS, batch, optimizer, SEED, n_devices, steps)
    return fw, runner, trace


def before_batchnorm(parameter):
    """A convolution's bias that a BatchNorm follows (stem.conv, every block's conv1 and conv2; not the shortcut's
    conv3): BatchNorm subtracts it out, so its true gradient is 0, and an engine's momentum buffer of it is rounding
    noise about 0 with no scale to hold it to."""
    return parameter.endswith(".bias") and (".conv1." in parameter or ".conv2." in parameter
                                            or parameter == "stem.conv.bias")


@pytest.mark.parametrize("bn,name", SCRATCH, ids=[f"{bn}-{name}" for bn, name in SCRATCH])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_one_scratch_step_trains_the_resnet_as_the_spec_says(framework, bn, name, digits, scratch_runners):
    optimizer = canonical(name)
    fw, runner, trace = run(scratch_runners, framework, "scratch", 2, bn, optimizer, digits, STEPS)
    model, _ = scratch(framework, "resnet", sync=bn == "sync")
    (error, where), _ = step_errors(fw, digits, optimizer, trace, EPOCHS, BATCH, SEED, 2, model,
                                    init_bn_state("resnet18", WIDTH), 2, STEPS, units=runner.settings.units)
    assert error <= TOLERANCE, f"{where} differs from the spec's step by {error:.2e} > {TOLERANCE:.0e}"
    assert max(np.max(np.abs(trace[-1][k] - trace[0][k])) for k in trace[0]) > 100 * TOLERANCE   # it trained
    states = [fw.state_to_numpy(state, runner.functional) for state in runner.states]   # every replica's, the same
    assert all(state["step"] == STEPS for state in states)
    assert {k for k in states[0] if k != "step"} == {f"{slot}.{p}" for slot in optimizer.slots for p in trace[0]}
    for state in states[1:]:
        assert all(np.array_equal(state[k], states[0][k]) for k in state if k != "step")


@pytest.mark.parametrize("framework,mode,n_devices", ENGINES, ids=[f"{f}-{m}-{n}d" for f, m, n in ENGINES])
def test_every_engine_trains_the_resnet_with_its_own_optimizer(framework, mode, n_devices, digits, scratch_runners):
    optimizer = canonical("momentum", STEPS_ENGINE, lr=0.1, weight_decay=0.05)
    shape = {"width": ENGINE_WIDTH, "batch": ENGINE_BATCH}
    _, engine, got = run(scratch_runners, framework, mode, n_devices, "local", optimizer, digits, STEPS_ENGINE, **shape)
    _, recipe, want = run(scratch_runners, framework, "scratch", n_devices, "local", optimizer, digits, STEPS_ENGINE,
                          **shape)
    tol = TOL
    relative = lambda a, b: float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b))))   # noqa: E731
    for name, value in want[-1].items():
        assert relative(got[-1][name], value) <= tol, f"{framework} {mode}: {name}"
    # The buffers are sums of gradients, which carry BatchNorm's rounding undamped (3.4e-3 in PyTorch's, 8% of a small
    # BatchNorm shift's buffer in MXNet's): each is held to STATE_TOL of its own size, a check of names and layouts
    # (a buffer under another parameter's name or transposed is off by its whole size), not of rounding.
    state, want_state = engine.optimizer_state(), recipe.optimizer_state()
    assert sorted(state) == sorted(want_state) and state["step"] == STEPS_ENGINE
    for key in want_state.keys() - {"step"}:
        if before_batchnorm(key.split(".", 1)[1]):   # rounding noise about 0 (compared above): no scale to hold it to
            continue
        error = float(np.max(np.abs(state[key] - want_state[key])))
        assert error <= STATE_TOL * float(np.max(np.abs(want_state[key]))), f"{framework} {mode}: {key} off by {error}"
