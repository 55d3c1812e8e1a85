"""Stateful optimizers, proven equal to the spec (common/optim.py) in every framework and mode.

Every mode runs the harness's own loop for 23 steps under a warm-up then a cosine schedule, which changes the rate
every step, with weight decay and a clipping norm that clips some steps and not others; each step is then checked
against the spec's step from the same weights (harness/studies/stepcheck.py says why step by step). Tolerance per step: the
frameworks' float32 rounding of the same update in another order is ~1e-7 here (measured <= 2e-7); each convention
slip moves a step's weights by 1e-4 or more (the rate inside the momentum buffer: ~lr * momentum * |v| * the rate's
change; clipping per shard: the shards' norms are not the global one; coupled decay in adamw: the decay divided by
sqrt(v)), and the tests fail on each (checked by breaking the code on purpose).
"""
import numpy as np
import pytest

from common import optim
from common.interface import FRAMEWORKS
from conftest import assert_evaluated_together, framework_or_skip, scratch
from common.lenet import init_weights
from harness.loader import load_module
from harness.studies.stepcheck import step_errors, traced
from harness.spec import RunSpec
from harness.training.loop import steps_per_epoch

BATCH, EPOCHS, SEED = 64, 1, 0    # digits: 23 steps, the last one short (a batch of 29)
WARMUP = 5
CLIP = 3.5                        # the mean gradient's norm on digits is ~2-7 in these runs: some steps clip
DECAY = {"sgd": 5e-4, "momentum": 5e-4, "nesterov": 5e-4, "adam": 5e-4, "adamw": 5e-2, "rmsprop": 5e-4,
         "adagrad": 5e-4}
TOLERANCE = 1e-5
# rmsprop with all three of its buffers: the squares' average, the gradients' (centered) and momentum's
VARIANT = {"rmsprop": {"centered": True}}


def canonical(name, total_steps, clip_norm=CLIP):
    return optim.Optimizer(name, optim.DEFAULT_LR[name], 0.9, DECAY[name], "cosine", WARMUP, total_steps, clip_norm,
                           **VARIANT.get(name, {}))


def total_steps(data, n_devices):
    return EPOCHS * steps_per_epoch(len(data.y_train), BATCH, n_devices)


def assert_follows_the_spec(fw, data, optimizer, n_devices, trace, what):
    """Each step against the spec's from the gradient of the scratch step's compiled units (conftest.scratch: made
    once a session), which compute the LeNet's gradient as the written ones do: JAX's written ones run op by op, 0.15 s
    a batch here, and a run of 23 steps asks for 23."""
    model, settings = scratch(fw.name)
    (error, where), coefficients = step_errors(fw, data, optimizer, trace, EPOCHS, BATCH, SEED, n_devices, model,
                                               units=settings.units)
    assert 0 < sum(c < 1 for c in coefficients) < len(coefficients), coefficients   # clipping on some steps only
    assert error <= TOLERANCE, f"{what}: {where} differs from the spec's step by {error:.2e} > {TOLERANCE:.0e}"


def test_a_step_that_made_nan_weights_is_infinitely_far_from_the_spec_s(digits):
    """max() passes over a NaN (nan > x is False): a run whose weights became NaN matched every step."""
    fw = framework_or_skip("pytorch")
    weights = init_weights(0)
    nan = {name: np.full_like(w, np.nan) for name, w in weights.items()}
    (error, where), _ = step_errors(fw, digits, optim.Optimizer(), [weights, nan], EPOCHS, BATCH, SEED, max_steps=1,
                                    model=scratch(fw.name)[0])
    assert (error, where) == (np.inf, "step 0, conv1.weight")


# ---- the spec itself (numpy only) ----

def test_the_schedule_warms_up_then_follows_cosine_and_step():
    o = optim.Optimizer("sgd", 1.0, schedule="cosine", warmup_steps=4, total_steps=24)
    assert [o.learning_rate(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert o.learning_rate(4) == 1.0 and o.learning_rate(14) == pytest.approx(0.5)
    assert 0 < o.learning_rate(23) < 0.01
    s = optim.Optimizer("sgd", 1.0, schedule="step", warmup_steps=4, total_steps=24)
    assert s.milestones == (14, 19)
    assert [s.learning_rate(t) for t in (13, 14, 18, 19, 23)] == pytest.approx([1, 0.1, 0.1, 0.01, 0.01])
    assert optim.scaled_lr(0.1, 1024, "linear") == pytest.approx(0.4) and optim.scaled_lr(0.1, 1024) == 0.1


def test_the_recipe_is_only_plain_constant_sgd():
    assert optim.Optimizer().is_recipe
    for change in ({"name": "momentum"}, {"schedule": "cosine"}, {"weight_decay": 1e-4}, {"clip_norm": 1.0},
                   {"warmup_steps": 1}):
        assert not optim.Optimizer(**change).is_recipe, change


def random_problem(seed=1):
    rng = np.random.default_rng(seed)
    w = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in w.items()} for _ in range(6)]
    return w, grads


def run_spec(o, w, grads):
    state = optim.init_state(o, w)
    for g in grads:
        w, state = optim.step(o, w, g, state)
    return w, state


def test_momentum_keeps_the_rate_outside_the_buffer():
    """PyTorch's v = mu v + g; w -= lr v, written out by hand; Keras/MXNet's rate inside the buffer differs once the
    rate changes."""
    w0, grads = random_problem()
    o = optim.Optimizer("momentum", 0.1, momentum=0.9, schedule="cosine", warmup_steps=2, total_steps=6)
    w, state = run_spec(o, w0, grads)
    want, v, inside = dict(w0), {k: 0 * x for k, x in w0.items()}, {k: 0 * x for k, x in w0.items()}
    w_inside = dict(w0)
    for t, g in enumerate(grads):
        lr = o.learning_rate(t)
        for k in w0:
            v[k] = 0.9 * v[k] + g[k]
            want[k] = want[k] - lr * v[k]
            inside[k] = 0.9 * inside[k] - lr * g[k]
            w_inside[k] = w_inside[k] + inside[k]
    for k in w0:
        np.testing.assert_allclose(w[k], want[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state[f"momentum_buffer.{k}"], v[k], rtol=1e-5, atol=1e-6)
        assert np.max(np.abs(w_inside[k] - want[k])) > 1e-2   # the convention matters under a schedule


def test_nesterov_adam_adamw_and_clipping_by_hand():
    w0, grads = random_problem()
    g = grads[0]
    norm = np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
    clipped = optim.Optimizer("sgd", 0.1, clip_norm=norm / 2)
    w, _ = optim.step(clipped, w0, g, optim.init_state(clipped, w0))
    for k in w0:   # the whole gradient scaled by clip / (norm + 1e-6): its global norm, not each tensor's
        np.testing.assert_allclose(w[k], w0[k] - 0.1 * g[k] * (norm / 2) / (norm + 1e-6), rtol=1e-6)
    nesterov = optim.Optimizer("nesterov", 0.1, momentum=0.9)
    w, _ = run_spec(nesterov, w0, grads[:2])
    for k in w0:   # v1 = g0, v2 = 0.9 g0 + g1; w -= lr (g + 0.9 v)
        step1, step2 = grads[0][k] + 0.9 * grads[0][k], grads[1][k] + 0.9 * (0.9 * grads[0][k] + grads[1][k])
        np.testing.assert_allclose(w[k], w0[k] - 0.1 * step1 - 0.1 * step2, rtol=1e-5, atol=1e-6)
    adam = optim.Optimizer("adam", 0.01)
    w, _ = optim.step(adam, w0, g, optim.init_state(adam, w0))
    for k in w0:   # the first bias-corrected step is lr * g / (|g| + eps): about lr * sign(g)
        np.testing.assert_allclose(w[k], w0[k] - 0.01 * g[k] / (np.abs(g[k]) + 1e-8), rtol=1e-5)
    coupled, decoupled = (optim.Optimizer(name, 0.01, weight_decay=0.1) for name in ("adam", "adamw"))
    w_coupled, _ = run_spec(coupled, w0, grads)
    w_decoupled, _ = run_spec(decoupled, w0, grads)
    wd_step = optim.step(decoupled, w0, {k: 0 * x for k, x in w0.items()}, optim.init_state(decoupled, w0))[0]
    for k in w0:   # a zero gradient: adamw only shrinks the weights by lr * wd; adam's L2 would move them by ~lr
        np.testing.assert_allclose(wd_step[k], w0[k] * (1 - 0.01 * 0.1), rtol=1e-6)
        assert np.max(np.abs(w_coupled[k] - w_decoupled[k])) > 1e-3


# ---- the contract's state functions ----

@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_replicas_state_is_held_like_its_weights_and_converts_back_exactly(framework):
    """init_state's zeros and state_from_numpy's buffers, in every layout of the framework's scratch step: the
    buffers held as the replica's parameters are (channels-last where they are) come back canonical, exactly."""
    from common import resnet
    fw = framework_or_skip(framework)
    execution = load_module(framework, "execution")
    o, (device,) = optim.Optimizer("adam"), fw.get_devices(1)
    rng = np.random.default_rng(1)
    for network, weights in (("lenet", init_weights()), ("resnet", resnet.init_weights(0, 4))):
        arrays = {"step": 7, **{key: rng.normal(size=w.shape).astype(np.float32)
                                for key, w in optim.init_state(o, weights).items() if key != "step"}}
        for layout in execution.LAYOUTS:
            model, _ = scratch(framework, network, layout)
            replica = model.get_params(weights, device)
            zeros = fw.state_to_numpy(fw.init_state(replica, o), model)
            state = fw.state_to_numpy(fw.state_from_numpy(arrays, replica, o, model), model)
            assert state.keys() == zeros.keys() == arrays.keys() and (state["step"], zeros["step"]) == (7, 0)
            for key in arrays.keys() - {"step"}:
                assert np.array_equal(state[key], arrays[key]), (network, layout, key)
                assert zeros[key].shape == arrays[key].shape and not zeros[key].any(), (network, layout, key)


# ---- every framework and mode against the spec ----

# Scratch mode on 2 devices (its update is written by hand for each optimizer, after its own all-reduce; one device
# runs the same code without the sum) takes every optimizer, the idiomatic loop every stateful one (each a class of the
# framework). The built-in engines run the idiomatic loop's classes: adamw (decoupled decay, two moments, under a
# changing rate) shows that the engine clips and updates after its all-reduce, on every replica.
IN_PROCESS = {("scratch", 2): optim.OPTIMIZERS, ("idiomatic", 1): optim.OPTIMIZERS[1:],
              ("builtin", 2): ("adamw",)}   # PyTorch's builtin: processes (test_engines_compute_the_spec)
FAST = {("scratch", 2, "momentum")}   # the fast tier's share; the rest is slow


def cases():
    for framework in FRAMEWORKS:
        for (mode, n_devices), names in IN_PROCESS.items():
            if (framework, mode) == ("pytorch", "builtin"):
                continue
            for name in names:
                marks = () if (mode, n_devices, name) in FAST else (pytest.mark.slow,)
                yield pytest.param(framework, mode, n_devices, name, marks=marks,
                                   id=f"{framework}-{mode}-{n_devices}d-{name}")


@pytest.mark.parametrize("framework,mode,n_devices,name", cases())
def test_every_mode_computes_the_spec(framework, mode, n_devices, name, digits, scratch_runners):
    """Scratch mode's runs of the five optimizers share one runner (conftest.scratch_runners: its compiled step made
    once, each run started afresh from the initial weights and a zero state)."""
    fw = framework_or_skip(framework)
    optimizer = canonical(name, total_steps(digits, n_devices))
    runner = scratch_runners(RunSpec(framework, mode=mode, devices=n_devices, batch_size=BATCH))
    trace, _ = traced(runner, digits, EPOCHS, BATCH, optimizer, SEED, n_devices)
    assert_follows_the_spec(fw, digits, optimizer, n_devices, trace, f"{framework} {mode} {n_devices}d {name}")
    if mode == "scratch":   # every replica keeps the same state, counted in steps
        states = [fw.state_to_numpy(state, runner.functional) for state in runner.states]
        assert all(state["step"] == optimizer.total_steps for state in states)
        for state in states[1:]:
            assert all(np.array_equal(state[k], states[0][k]) for k in state if k != "step")


# ---- what a naive port gets (harness.studies.conventions, docs/migration.md) ----

STOCK_DIFFERS = {"pytorch": False, "mxnet": True, "tensorflow": True, "jax": True}   # PyTorch's is the spec


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_stock_classes_are_what_the_conventions_table_says(framework, digits):
    """The idiomatic loop with the framework's stock classes, the same hyperparameters passed to them: momentum under
    a warm-up off the spec by far more than rounding in MXNet (the rate inside the buffer), Keras (the same) and
    Optax (its warm-up starts from 0); on it in PyTorch, whose conventions the spec is."""
    from harness.studies.conventions import port_row
    fw = framework_or_skip(framework)
    error, _, stock_error, _ = port_row(fw, "momentum", digits, EPOCHS)
    assert error <= TOLERANCE
    assert (stock_error > 100 * TOLERANCE) if STOCK_DIFFERS[framework] else stock_error <= TOLERANCE, stock_error


# ---- the multi-process engines (real worker processes: slow tier) ----

# 2 devices, 2 processes, accumulating (--accumulate K: each device's shard in K micro-batches, one all-reduce per
# update), which for the LeNet is the spec's step of the whole batch. The scratch step's sum across processes without
# accumulation is test_engines.py's; its update after the sum is the in-process cases' above.
ENGINES = [("builtin", "adamw", 2), ("scratch", "adamw", 4)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,name,accumulate", ENGINES, ids=[f"{m}-{n}-accumulate{k}" for m, n, k in ENGINES])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_engines_compute_the_spec(framework, mode, name, accumulate, digits, tmp_path):
    """DDP, MultiWorkerMirroredStrategy, the dist_sync kvstore and jax.distributed, and the scratch step across
    processes, with the options a user gives compare.py, accumulating: the same weights as the spec."""
    from harness.processes.launch import run_workers
    fw = framework_or_skip(framework)
    per_epoch = steps_per_epoch(len(digits.y_train), BATCH, 2)
    optimizer = canonical(name, EPOCHS * per_epoch)
    out = tmp_path / "trace.npz"
    spec = {"framework": framework, "mode": mode, "devices": 2, "processes": 2, "dataset": "digits",
            "epochs": EPOCHS, "batch_size": BATCH, "seed": SEED, "threads": 1, "weights_trace": str(out),
            "optimizer": name, "lr": optimizer.lr, "momentum": optimizer.momentum,
            "weight_decay": optimizer.weight_decay, "lr_schedule": optimizer.schedule,
            "warmup_epochs": WARMUP / per_epoch, "clip_norm": optimizer.clip_norm, "accumulate": accumulate}
    results = run_workers(spec, timeout=400)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    assert len({r["digest"] for r in results}) == 1, "processes hold different weights"
    arrays = np.load(out)
    trace = [{} for _ in range(optimizer.total_steps + 1)]
    for key in arrays.files:
        step, param = key.split("/")
        trace[int(step)][param] = arrays[key]
    assert_follows_the_spec(fw, digits, optimizer, 2, trace, f"{framework} {mode} 2 processes {name}")
    assert_evaluated_together(results, fw, trace[-1], digits)
