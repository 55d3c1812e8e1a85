"""TensorFlow's optimizer.py beyond the parity runs: the Keras schedule gives the spec's rate at every step, states
convert to the canonical form and back, Keras 3's own global_clipnorm clips each replica's shard under
MirroredStrategy (why builtin.py sums the gradients before the trainer sees them), and the stock port is not the
spec. And rmsprop and adagrad, cheaply (the LeNet's gradients of a few small batches, no runner): the scratch update
and the canonical Keras classes step for step against the spec, their states through Keras's checkpoint and back,
and stock Keras code continuing such a state."""
import numpy as np
import pytest

from common import optim
from common.layouts import to_canonical, to_channels_last
from common.lenet import PARAM_NAMES, init_weights
from conftest import EXPLICIT_SCHEDULES, framework_or_skip
from harness.loader import load_module


@pytest.fixture(scope="module")
def fw():
    fw = framework_or_skip("tensorflow")
    fw.get_devices(1)   # the CPU split into logical devices before TensorFlow runs anything
    return fw


@pytest.mark.parametrize("given", [{"schedule": s} for s in optim.SCHEDULES] + EXPLICIT_SCHEDULES,
                         ids=list(optim.SCHEDULES) + [f"{e['schedule']}-given" for e in EXPLICIT_SCHEDULES])
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_the_keras_schedule_is_the_spec_rate_at_every_step(fw, given, warmup):
    o = optim.Optimizer("momentum", 0.02, warmup_steps=warmup, total_steps=24, **given)
    rate = load_module("tensorflow", "optimizer").get_schedule(o)
    for step in range(o.total_steps):
        got = float(rate(step)) if callable(rate) else rate
        assert got == pytest.approx(o.learning_rate(step), rel=1e-6, abs=1e-9), step


def test_keras_clips_each_replicas_gradient_before_its_sum(fw):
    """Two replicas' gradients (3, 0) and (0, 4), clipped to norm 1: the global batch's sum (3, 4) clips to
    (0.6, 0.8); Keras's stock SGD clips each replica's to (1, 0) and (0, 1) and sums those. optimizer.SGD, given the
    sum as builtin.py's step gives it, applies the clipped sum."""
    import tensorflow as tf
    opt = load_module("tensorflow", "optimizer")
    devices = fw.get_devices(2)
    strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice(devices[0]))

    def step(trainer, w, sum_first):
        def replica_step():
            context = tf.distribute.get_replica_context()
            g = tf.constant([[3.0, 0.0], [0.0, 4.0]])[context.replica_id_in_sync_group]
            if sum_first:
                g = context.all_reduce("sum", g)
            trainer.apply_gradients([(g, w)])
        tf.function(lambda: strategy.run(replica_step))()
        return w.numpy()

    with strategy.scope():
        stock = tf.keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=1.0)
        ours = opt.SGD(learning_rate=1.0, global_clipnorm=1.0)
        w_stock, w_ours = tf.Variable([0.0, 0.0]), tf.Variable([0.0, 0.0])
    np.testing.assert_allclose(step(stock, w_stock, sum_first=False), [-1.0, -1.0], rtol=1e-6)
    np.testing.assert_allclose(step(ours, w_ours, sum_first=True), [-0.6, -0.8], rtol=1e-6)


# ---- rmsprop and adagrad: the scratch update, the canonical Keras classes, their state in Keras's files ----

STEPS = 4   # each run's updates, all inside its warm-up: the rate changes at every one
KINDS = ("rmsprop", "rmsprop-centered-momentum", "adagrad")   # the rmsprop with all three buffers, and the plain one
SPEC_TOLERANCE = 1e-6   # float32's rounding of the same update in another order (measured: 0, equal to the bit)


def adaptive(kind, **given):
    """rmsprop (centered, with momentum 0.9, if `kind` says so) or adagrad at its usual rate, with L2 weight decay
    and a warm-up that changes the rate at every step (a rate inside the momentum buffer would show)."""
    name = kind.split("-")[0]
    options = {"lr": optim.DEFAULT_LR[name], "momentum": 0.9 if "momentum" in kind else None, "weight_decay": 5e-4,
               "warmup_steps": STEPS, "total_steps": 2 * STEPS, "centered": "centered" in kind}
    return optim.Optimizer(name, **{**options, **given})


@pytest.fixture(scope="module")
def gradients(fw, digits):
    """The LeNet's mean gradients at its initial weights on STEPS batches of 16 digits (canonical): gradients of real
    sizes, from 1e-12 to 1e-2 and many exactly 0, where epsilon's place shows."""
    import tensorflow as tf
    model = load_module("tensorflow", "lenet").build_model(init_weights())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    found = []
    for k in range(STEPS):
        rows = slice(16 * k, 16 * (k + 1))
        with tf.GradientTape() as tape:
            loss = loss_fn(digits.y_train[rows], model(digits.X_train[rows], training=True))
        found.append({name: to_canonical(name, g.numpy()) for name, g in
                      zip(PARAM_NAMES, tape.gradient(loss, model.trainable_variables))})
    return found


def largest_difference(got, want, reference):
    """The largest |got - want| over the arrays (buffers or weights, canonical), each as a share of the largest
    |reference| of its array (for weights, how far the spec's steps moved them)."""
    return max(float(np.max(np.abs(got[key] - want[key]))) / max(float(np.max(np.abs(reference[key]))), 1e-30)
               for key in want if key != "step")


def movement(after, before):
    return {name: after[name] - before[name] for name in before}


@pytest.mark.parametrize("kind", KINDS)
def test_the_scratch_update_of_rmsprop_and_adagrad_is_the_spec(fw, kind, gradients):
    """optimizer.apply, the scratch step's update (given each step's mean gradient), against common.optim.step, step
    by step: the weights and every buffer."""
    import tensorflow as tf
    opt = load_module("tensorflow", "optimizer")
    model, (device,) = load_module("tensorflow", "lenet").Functional(), fw.get_devices(1)
    o, start = adaptive(kind), init_weights()
    params = model.get_params(start, device)
    state, want, want_state = opt.init_state(params, o), start, optim.init_state(o, start)
    for step, grads in enumerate(gradients):
        with tf.device(device):
            native = [tf.constant(to_channels_last(name, grads[name])) for name in PARAM_NAMES]
            opt.apply(params, native, state, tf.constant(o.learning_rate(step), tf.float32), 1)
        want, want_state = optim.step(o, want, grads, want_state)
        got, got_state = model.to_numpy(params), fw.state_to_numpy(state, model)
        assert got_state.keys() == want_state.keys() and got_state["step"] == step + 1
        assert largest_difference(got, want, movement(want, start)) <= SPEC_TOLERANCE, (kind, step)
        assert largest_difference(got_state, want_state, want_state) <= SPEC_TOLERANCE, (kind, step)


@pytest.mark.parametrize("kind", KINDS)
def test_the_canonical_keras_rmsprop_and_adagrad_are_the_spec(fw, kind, gradients):
    """get_trainer's Keras optimizer (optimizer.RMSprop, optimizer.Adagrad) on its own schedule, fed each step's mean
    gradient as the built-in and idiomatic modes feed it, against common.optim.step; its state read out canonical."""
    import keras
    opt = load_module("tensorflow", "optimizer")
    o, start = adaptive(kind), init_weights()
    variables = {name: keras.Variable(to_channels_last(name, start[name]), name=name) for name in PARAM_NAMES}
    trainer = opt.get_trainer(o)
    trainer.build(list(variables.values()))
    want, want_state = start, optim.init_state(o, start)
    for step, grads in enumerate(gradients):
        trainer.apply_gradients([(to_channels_last(name, grads[name]), variables[name]) for name in PARAM_NAMES])
        want, want_state = optim.step(o, want, grads, want_state)
        got = {name: to_canonical(name, variable.numpy()) for name, variable in variables.items()}
        got_state = opt.canonical_state(trainer, variables)
        assert got_state.keys() == want_state.keys() and got_state["step"] == step + 1
        assert largest_difference(got, want, movement(want, start)) <= SPEC_TOLERANCE, (kind, step)
        assert largest_difference(got_state, want_state, want_state) <= SPEC_TOLERANCE, (kind, step)


STATE_KINDS = ("rmsprop", "rmsprop-centered", "rmsprop-momentum", "rmsprop-centered-momentum", "adagrad")


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_an_rmsprop_or_adagrad_state_reads_back_from_keras_s_file_exactly(fw, kind, tmp_path):
    """checkpoint.save_state, then read_state: the canonical buffers of each rmsprop (its slots: the squares'
    average; the gradients' if centered; momentum's, which Keras's file holds times the rate, beside the canonical
    ones) and adagrad, exactly, told apart from Adam's (rmsprop-momentum's two Keras suffixes are Adam's too)."""
    checkpoint = load_module("tensorflow", "checkpoint")
    o = adaptive(kind)
    rng = np.random.default_rng(5)
    state = {key: (7 if key == "step" else np.abs(rng.normal(size=value.shape)).astype(np.float32))
             for key, value in optim.init_state(o, init_weights()).items()}
    checkpoint.save_state(state, o, str(tmp_path / "state"))
    got = checkpoint.read_state(str(tmp_path / "state"))
    assert got.keys() == state.keys() and got["step"] == 7
    for key in state.keys() - {"step"}:
        assert np.array_equal(to_canonical(key.split(".", 1)[1], got[key]), state[key]), key
    assert checkpoint.rate_inside(o) == ("keras.optimizers.RMSprop" if "momentum" in kind else None)


BEFORE, AFTER = 3, 3   # the spec's steps before the state is saved, and the stock class's after it
# An epsilon far below float32's resolution of every nonzero average of squares here (the smallest is ~5e-14 after
# these steps): 1e-24 changes no denominator, inside the square root (stock Keras) or outside it (the spec), so the
# stock class's epsilon inside it costs nothing and the steps differ by rounding alone. At torch's 1e-8 the LeNet's
# small gradients (1e-12 to 1e-4) are divided by sqrt(s + 1e-8) instead of sqrt(s) + 1e-8: each step is off by 30%
# (rmsprop) to 85% (adagrad) of its movement (measured).
TINY_EPS = 1e-24
# Of each step's movement: Keras's own order of the same operations, and its momentum holding the rate times the
# canonical buffer, rounded (measured: 3.7e-6 for rmsprop, 0 for adagrad)
STOCK_TOLERANCE = 1e-5


@pytest.mark.parametrize("kind", ["rmsprop-centered-momentum", "adagrad"])
def test_stock_keras_continues_a_canonical_rmsprop_or_adagrad_state(fw, kind, digits, tmp_path):
    """The spec's run of BEFORE steps at a constant rate, saved as the project saves it (checkpoint.save, save_state),
    then stock Keras code as its guides write it: keras.optimizers.RMSprop (Adagrad) given the same
    hyperparameters, built, restored with tf.train.Checkpoint(optimizer=...).read, the weights loaded, L2 weight decay
    added to the loss, trained on. Each of its steps is the spec's from the same weights at the same (constant) rate:
    its momentum restored with the rate inside (the file holds lr * the canonical buffer), its squares' averages, its
    sum as they were (Keras's initial_accumulator_value 0.1 overwritten)."""
    import keras
    import tensorflow as tf
    checkpoint, lenet = load_module("tensorflow", "checkpoint"), load_module("tensorflow", "lenet")
    o = adaptive(kind, eps=TINY_EPS, warmup_steps=0, total_steps=BEFORE + AFTER)
    batches = [(digits.X_train[16 * k:16 * (k + 1)], digits.y_train[16 * k:16 * (k + 1)])
               for k in range(BEFORE + AFTER)]
    model = lenet.build_model(init_weights())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def mean_gradient(X, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(X, training=True))
        return {name: to_canonical(name, g.numpy())
                for name, g in zip(PARAM_NAMES, tape.gradient(loss, model.trainable_variables))}

    weights, state = init_weights(), optim.init_state(o, init_weights())
    for X, y in batches[:BEFORE]:
        model.set_weights([to_channels_last(name, weights[name]) for name in PARAM_NAMES])
        weights, state = optim.step(o, weights, mean_gradient(X, y), state)
    checkpoint.save(weights, str(tmp_path / "lenet.weights.h5"))
    checkpoint.save_state(state, o, str(tmp_path / "lenet.optimizer.ckpt"))

    model = lenet.build_model(init_weights())   # the user's program
    if o.name == "rmsprop":
        optimizer = keras.optimizers.RMSprop(learning_rate=o.lr, rho=o.alpha, momentum=o.momentum,
                                             epsilon=TINY_EPS, centered=o.centered)
    else:
        optimizer = keras.optimizers.Adagrad(learning_rate=o.lr, epsilon=TINY_EPS)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=optimizer).read(str(tmp_path / "lenet.optimizer.ckpt" / "optimizer")) \
        .expect_partial()
    model.load_weights(tmp_path / "lenet.weights.h5")
    for X, y in batches[BEFORE:]:
        before = lenet.to_numpy(model.trainable_variables)
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(y, model(X, training=True))
            objective = loss + o.weight_decay * tf.add_n([tf.nn.l2_loss(w) for w in model.trainable_variables])
        optimizer.apply_gradients(zip(tape.gradient(objective, model.trainable_variables),
                                      model.trainable_variables))
        grads = {name: to_canonical(name, g.numpy())   # the spec adds the decay itself
                 for name, g in zip(PARAM_NAMES, tape.gradient(loss, model.trainable_variables))}
        want, state = optim.step(o, before, grads, state)
        got = lenet.to_numpy(model.trainable_variables)
        assert largest_difference(got, want, movement(want, before)) <= STOCK_TOLERANCE, (kind, state["step"])
