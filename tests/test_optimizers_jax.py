"""JAX's optimizer pieces against the spec one at a time, on a fixed sequence of gradients (no training: nothing
amplifies rounding, so the tolerances are tight): the scratch update at every exec level, Optax's transformation
and schedules, the state's layouts, and the naive port's one difference."""
import numpy as np
import pytest

from common import optim
from common.lenet import PARAM_SHAPES, init_weights
from conftest import EXPLICIT_SCHEDULES, framework_or_skip, replicas_of, scratch, train_steps, weights_of
from harness.loader import load_module

STEPS, BATCH = 12, 128


@pytest.fixture(scope="module")
def jax_fw():
    return framework_or_skip("jax")


def problem(name):
    """An optimizer whose rate changes every step and whose clipping acts on some steps only, and its gradients:
    global batch means (the summed gradient is mean * BATCH, exactly)."""
    rng = np.random.default_rng(0)
    grads = [{k: (rng.normal(size=s) * 0.3 ** (t % 3)).astype(np.float32) for k, s in PARAM_SHAPES.items()}
             for t in range(STEPS)]
    o = optim.Optimizer(name, optim.DEFAULT_LR[name], 0.9, 5e-2, "cosine", 4, STEPS, clip_norm=50.0)
    coefficients = [o.clip_coefficient(g) for g in grads]
    assert 0 < sum(c < 1 for c in coefficients) < STEPS, coefficients
    return o, grads


def spec(o, grads):
    w, state = init_weights(0), optim.init_state(o, init_weights(0))
    for g in grads:
        w, state = optim.step(o, w, g, state)
    return w, state


def assert_close(got, want, tolerance):
    for name, value in want.items():
        error = float(np.max(np.abs(np.asarray(got[name], np.float32) - value)))
        assert error <= tolerance, f"{name}: {error:.2e} > {tolerance:.0e}"


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
@pytest.mark.parametrize("level", ["eager", "graph"])
def test_the_scratch_update_is_the_spec_at_every_level(jax_fw, name, level):
    optimizer = load_module("jax", "optimizer")
    o, grads = problem(name)
    want, want_state = spec(o, grads)
    (device,) = jax_fw.get_devices(1)
    model, settings = scratch("jax", level=level)
    params = model.get_params(init_weights(0), device)
    state = jax_fw.init_state(params, o)
    for t, g in enumerate(grads):
        summed = model.get_params({k: v * np.float32(BATCH) for k, v in g.items()}, device)
        optimizer.apply(params, summed, state, o.learning_rate(t), BATCH, settings.units["optimizer.update"])
    assert_close(model.to_numpy(params), want, 1e-6)
    got_state = jax_fw.state_to_numpy(state, model)
    assert got_state.pop("step") == STEPS
    assert_close(got_state, {k: v for k, v in want_state.items() if k != "step"}, 1e-6)


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_optax_computes_the_spec(jax_fw, name):
    """optimizer.transformation: Optax's stock classes and schedules, driven by their own step count."""
    import optax
    optimizer, lenet = load_module("jax", "optimizer"), load_module("jax", "lenet")
    o, grads = problem(name)
    want, _ = spec(o, grads)
    (device,) = jax_fw.get_devices(1)
    tx = optimizer.get_trainer(o)
    params = lenet.get_params(init_weights(0), device)
    opt_state = tx.init(params)
    for g in grads:
        updates, opt_state = tx.update(lenet.get_params(g, device), opt_state, params)
        params = optax.apply_updates(params, updates)
    assert_close(lenet.to_numpy(params), want, 1e-6)


RUNS = [(0, 24), (1, 24), (5, 24), (5, 6), (5, 7), (3, 3), (10, 2000)]   # (warm-up, total)
CASES = [({"schedule": schedule}, warmup, total) for schedule in optim.SCHEDULES for warmup, total in RUNS] + \
    [(given, warmup, 24) for given in EXPLICIT_SCHEDULES for warmup in (0, 5)]   # given: over a run they fit


@pytest.mark.parametrize("given,warmup,total", CASES, ids=[
    f"{g['schedule']}{'-given' if len(g) > 1 else ''}-warmup{w}-{t}steps" for g, w, t in CASES])
def test_optax_schedules_give_the_spec_rates(jax_fw, given, warmup, total):
    """Optax's count is 0 at the first update, as the spec's step; the warm-up is lr (step + 1) / W, and in a
    short run both of the step schedule's milestones can fall on one step."""
    optimizer = load_module("jax", "optimizer")
    o = optim.Optimizer("sgd", 0.02, warmup_steps=warmup, total_steps=total, **given)
    rate = optimizer.get_schedule(o)
    got = np.array([float(rate(t)) for t in range(total)])
    want = [o.learning_rate(t) for t in range(total)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * o.lr)   # Optax's cosine is float32


def test_the_stock_port_warms_up_from_zero(jax_fw):
    """The naive port's one difference in Optax (idiomatic.py's port="stock"): its usual warm-up starts at 0, so
    the first update does nothing and the rest of the warm-up runs a step behind."""
    optimizer = load_module("jax", "optimizer")
    o = optim.Optimizer("momentum", 0.02, schedule="cosine", warmup_steps=4, total_steps=20)
    stock = optimizer.get_schedule(o, "stock")
    assert [float(stock(t)) for t in range(5)] == pytest.approx([0, 0.005, 0.01, 0.015, 0.02])
    after = [o.learning_rate(t) for t in range(4, 20)]
    assert [float(stock(t)) for t in range(4, 20)] == pytest.approx(after, abs=1e-6 * o.lr)


@pytest.mark.slow   # trains: the slow tier
def test_the_stock_port_through_the_idiomatic_loop(jax_fw, digits):
    idiomatic = load_module("jax", "idiomatic")
    o = optim.Optimizer("momentum", 0.02, schedule="cosine", warmup_steps=4, total_steps=20)
    devices = jax_fw.get_devices(1)
    X, y = digits.X_train[:64], digits.y_train[:64]
    for port, moves in (("canonical", True), ("stock", False)):
        model = idiomatic.get_model(init_weights(0), devices, o, port=port)
        idiomatic.train_step(model, X, y, devices, o.learning_rate(0), len(X))
        change = max(float(np.max(np.abs(v - init_weights(0)[k]))) for k, v in idiomatic.to_numpy(model).items())
        assert (change > 0) == moves, (port, change)


@pytest.mark.slow   # trains: the slow tier
@pytest.mark.parametrize("form,name", [("jit", "adamw"), ("shard_map", "momentum")])
def test_both_builtin_forms_clip_the_all_reduced_gradient(jax_fw, digits, form, name):
    """Optax inside the built-in step, in both forms, on uneven shards of 3 devices: the scratch step's update
    (which clips after its all-reduce). The mean gradient's norm is ~1.8 here and each device's part of it ~0.6:
    a clip of 0.3 acts on both, so clipping each device's own part would give another update."""
    builtin, pipeline = load_module("jax", "builtin"), load_module("jax", "pipeline")
    o = optim.Optimizer(name, optim.DEFAULT_LR[name], 0.9, 5e-2, "cosine", 2, 4, clip_norm=0.3)
    devices = jax_fw.get_devices(3)
    replicas = replicas_of(jax_fw, init_weights(1), devices)
    states = [jax_fw.init_state(r, o) for r in replicas]
    model = builtin.get_model(init_weights(1), devices, o, form=form)
    for t, (a, b) in enumerate([(0, 101), (101, 198), (198, 299)]):
        X, y = digits.X_train[a:b], digits.y_train[a:b]
        loss = train_steps(jax_fw, replicas, X, y, devices, o.learning_rate(t), len(X), states)
        batch = pipeline.global_batch(model.placement, devices, X, y, len(X))
        assert builtin.train_step(model, batch, None, len(X)) == pytest.approx(loss, abs=1e-5)
    assert_close(builtin.to_numpy(model), weights_of(jax_fw, replicas[0]), 1e-6)
