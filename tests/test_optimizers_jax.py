"""JAX's optimizer pieces against the spec one at a time, on a fixed sequence of gradients (no training: nothing
amplifies rounding, so the tolerances are tight): the scratch update at every exec level, Optax's transformation
and schedules, the state's layouts, the naive port's warm-up, and a saved state continued by stock Optax code."""
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


# Every optimizer (rmsprop with momentum 0.9), and rmsprop's other buffers: the squares' average alone (no momentum),
# and all three (centered)
UPDATES = [(name, {}) for name in optim.OPTIMIZERS] + [("rmsprop", {"momentum": 0.0}), ("rmsprop", {"centered": True})]
UPDATE_IDS = [*optim.OPTIMIZERS, "rmsprop-no-momentum", "rmsprop-centered"]


def problem(name, **variant):
    """An optimizer whose rate changes every step and whose clipping acts on some steps only, and its gradients:
    global batch means (the summed gradient is mean * BATCH, exactly)."""
    rng = np.random.default_rng(0)
    grads = [{k: (rng.normal(size=s) * 0.3 ** (t % 3)).astype(np.float32) for k, s in PARAM_SHAPES.items()}
             for t in range(STEPS)]
    variant = {"momentum": 0.9, **variant}
    o = optim.Optimizer(name, optim.DEFAULT_LR[name], weight_decay=5e-2, schedule="cosine", warmup_steps=4,
                        total_steps=STEPS, clip_norm=50.0, **variant)
    coefficients = [o.clip_coefficient(g) for g in grads]
    assert 0 < sum(c < 1 for c in coefficients) < STEPS, coefficients
    return o, grads


def spec(o, grads):
    w, state = init_weights(0), optim.init_state(o, init_weights(0))
    for g in grads:
        w, state = optim.step(o, w, g, state)
    return w, state


def assert_close(got, want, tolerance):
    """Within `tolerance` of each array's largest entry, or of 1 where that is smaller: RMSprop's normalised steps
    make buffers of ~10-100, whose float32 rounding is ~1e-6 alone."""
    for name, value in want.items():
        error = float(np.max(np.abs(np.asarray(got[name], np.float32) - value)))
        bound = tolerance * max(1.0, float(np.max(np.abs(value))))
        assert error <= bound, f"{name}: {error:.2e} > {bound:.1e}"


@pytest.mark.parametrize("name,variant", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize("level", ["eager", "graph"])
def test_the_scratch_update_is_the_spec_at_every_level(jax_fw, name, variant, level):
    optimizer = load_module("jax", "optimizer")
    o, grads = problem(name, **variant)
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


@pytest.mark.parametrize("name,variant", UPDATES, ids=UPDATE_IDS)
def test_optax_computes_the_spec(jax_fw, name, variant):
    """optimizer.get_trainer: Optax's stock classes and schedules, driven by their own step count (RMSprop's and
    Adagrad's Optax's own parts in the spec's order)."""
    import optax
    optimizer, lenet = load_module("jax", "optimizer"), load_module("jax", "lenet")
    o, grads = problem(name, **variant)
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
    """The naive port's one difference in Optax for SGD, momentum and Adam (idiomatic.py's port="stock"; RMSprop's
    and Adagrad's stock arithmetic differs too: optimizer.get_trainer): its usual warm-up starts at 0, so the first
    update does nothing and the rest of the warm-up runs a step behind."""
    optimizer = load_module("jax", "optimizer")
    o = optim.Optimizer("momentum", 0.02, schedule="cosine", warmup_steps=4, total_steps=20)
    stock = optimizer.get_schedule(o, "stock")
    assert [float(stock(t)) for t in range(5)] == pytest.approx([0, 0.005, 0.01, 0.015, 0.02])
    after = [o.learning_rate(t) for t in range(4, 20)]
    assert [float(stock(t)) for t in range(4, 20)] == pytest.approx(after, abs=1e-6 * o.lr)


SAVED_AT = 4   # the updates made before a state is saved; STEPS - SAVED_AT follow


def stock_optax(o):
    """What stock Optax code writes for `o` (common.optim's), as test_stock_gluon_states's program does: the L2 weight
    decay chained before the optimizer. optax.rmsprop takes torch's eps placement as a stock argument
    (eps_in_sqrt=False) and here a constant rate, the number (its trace holds the rate: the file's trace is the
    canonical buffer times -lr); optax.adagrad has no such argument, and its schedule is Optax's usual warm-up and
    cosine."""
    import optax
    if o.name == "rmsprop":
        tx = optax.rmsprop(o.lr, o.alpha, o.eps, eps_in_sqrt=False, centered=o.centered, momentum=o.momentum)
    else:
        tx = optax.adagrad(optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, o.total_steps), eps=o.eps)
    return optax.chain(optax.add_decayed_weights(o.weight_decay), tx)


def stock_program(folder, tx, grads):
    """Stock Flax and Optax code: the LeNet and an nnx.Optimizer restored from their files as Flax's checkpointing
    guide restores them (Orbax, into their own state's structure), as test_stock_gluon_states's program does, then
    updated by each of `grads` (canonical arrays, laid out as nnx.grad gives them by the LeNet's own build) in one
    nnx.jit step: its step count after the restore, and the weights after each update."""
    import orbax.checkpoint as ocp
    from flax import nnx
    lenet = load_module("jax", "lenet")
    model = lenet.build_model(init_weights())
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    with ocp.StandardCheckpointer() as checkpointer:
        for saved, file in ((model, "lenet.orbax"), (optimizer, "lenet.optimizer.orbax")):
            state = nnx.state(saved)
            nnx.replace_by_pure_dict(state, checkpointer.restore(folder.absolute() / file, nnx.to_pure_dict(state)))
            nnx.update(saved, state)
    step, after = int(optimizer.step.value), []
    update = nnx.jit(lambda optimizer, model, grads: optimizer.update(model, grads))
    for g in grads:
        update(optimizer, model, nnx.state(lenet.build_model(g), nnx.Param))
        after.append(lenet.model_to_numpy(model))
    return step, after


# optax.adagrad adds eps inside the square root, 1 / sqrt(s + eps) where the spec has 1 / (sqrt(s) + eps): an entry's
# step differs by about eps / sqrt(s) of itself, under 1e-8 of the weights where every sum of squares s is above
# MIN_SUM (these gradients' are from 9.6e-4; checked), so the spec's tolerance holds. Where a gradient stays near 0,
# its sum near eps, the stock step shrinks: on LeNet's real gradients (digits, 8 batches of 32) the two part by up to
# a whole step, 0.0098 at lr 0.01, which no tolerance here would cover.
MIN_SUM = 5e-4


@pytest.mark.parametrize("name,variant", [("rmsprop", {"centered": True, "momentum": 0.9}), ("adagrad", {})],
                         ids=["rmsprop-centered-momentum", "adagrad"])
def test_stock_optax_code_continues_a_saved_state(jax_fw, name, variant, tmp_path):
    """A canonical state saved with checkpoint.save_state after SAVED_AT updates restores into stock optax.rmsprop
    (centered, with momentum: its three buffers) and optax.adagrad under nnx.Optimizer, and their next updates are
    the spec's from the same state. Adagrad's schedule is past its warm-up: Optax's count, restored, gives the
    spec's rates."""
    checkpoint = load_module("jax", "checkpoint")
    _, grads = problem(name)
    schedule = {} if name == "rmsprop" else {"schedule": "cosine", "warmup_steps": 2}
    o = optim.Optimizer(name, optim.DEFAULT_LR[name], weight_decay=5e-2, total_steps=STEPS, **schedule, **variant)
    weights, state = spec(o, grads[:SAVED_AT])
    assert all(np.min(state[f"sum.{k}"]) > MIN_SUM for k in PARAM_SHAPES if name == "adagrad")   # sums only grow
    checkpoint.save(weights, tmp_path / "lenet.orbax")
    checkpoint.save_state(state, o, tmp_path / "lenet.optimizer.orbax")
    step, after = stock_program(tmp_path, stock_optax(o), grads[SAVED_AT:])
    assert step == SAVED_AT
    for got, g in zip(after, grads[SAVED_AT:]):
        weights, state = optim.step(o, weights, g, state)
        assert_close(got, weights, 1e-6)


SAVED = [("rmsprop", {"centered": True, "momentum": 0.9, "schedule": "cosine", "warmup_steps": 3}),
         ("rmsprop", {}), ("adagrad", {})]


@pytest.mark.parametrize("name,variant", SAVED, ids=["rmsprop-centered-momentum-cosine", "rmsprop", "adagrad"])
def test_a_saved_state_reads_back_exactly(jax_fw, name, variant, tmp_path):
    """checkpoint.read_state(save_state(x)) is x, bit for bit: Optax's fields for each slot (ScaleByRStdDevState's
    mu and nu are the centered RMSprop's, not Adam's), and the momentum buffers kept beside the trace that holds the
    rate (a cosine's, after its warm-up: -lr * the buffer is no exact copy)."""
    from common.layouts import to_canonical
    checkpoint = load_module("jax", "checkpoint")
    o = optim.Optimizer(name, **variant, total_steps=20)
    rng = np.random.default_rng(1)
    want = {key: 7 if key == "step" else np.abs(rng.normal(size=a.shape)).astype(np.float32)
            for key, a in optim.init_state(o, init_weights(0)).items()}
    checkpoint.save_state(want, o, tmp_path / "lenet.optimizer.orbax")
    got = checkpoint.read_state(tmp_path / "lenet.optimizer.orbax")
    assert sorted(got) == sorted(want) and got["step"] == want["step"]
    for key in (k for k in want if k != "step"):
        assert np.array_equal(to_canonical(key.split(".", 1)[1], got[key]), want[key]), key


def test_a_stock_rmsprop_trace_alone_is_refused(jax_fw, tmp_path):
    """optax.rmsprop's momentum trace holds the rate, which its file does not say: without the canonical buffers
    save_state keeps beside it (a file stock Optax code wrote), read_state refuses it rather than misread it."""
    import shutil
    checkpoint = load_module("jax", "checkpoint")
    o = optim.Optimizer("rmsprop", momentum=0.9)
    checkpoint.save_state(optim.init_state(o, init_weights(0)), o, tmp_path / "lenet.optimizer.orbax")
    shutil.rmtree(tmp_path / "lenet.optimizer.orbax" / checkpoint.CANONICAL)
    with pytest.raises(ValueError, match="holds the rate"):
        checkpoint.read_state(tmp_path / "lenet.optimizer.orbax")


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
