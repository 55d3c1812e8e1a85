"""TensorFlow's optimizer.py beyond the parity runs: the Keras schedule gives the spec's rate at every step, states
convert to the canonical form and back, Keras 3's own global_clipnorm clips each replica's shard under
MirroredStrategy (why builtin.py sums the gradients before the trainer sees them), and the stock port is not the
spec."""
import numpy as np
import pytest

from common import optim
from common.lenet import init_weights
from conftest import framework_or_skip
from harness.loader import load_module
from test_optimizers import BATCH, EPOCHS, SEED, TOLERANCE, canonical, spec_run, total_steps


@pytest.fixture(scope="module")
def fw():
    fw = framework_or_skip("tensorflow")
    fw.get_devices(1)   # the CPU split into logical devices before TensorFlow runs anything
    return fw


@pytest.mark.parametrize("schedule", optim.SCHEDULES)
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_the_keras_schedule_is_the_spec_rate_at_every_step(fw, schedule, warmup):
    o = optim.Optimizer("momentum", 0.02, schedule=schedule, warmup_steps=warmup, total_steps=24)
    rate = load_module("tensorflow", "optimizer").schedule(o)
    for step in range(o.total_steps):
        got = float(rate(step)) if callable(rate) else rate
        assert got == pytest.approx(o.learning_rate(step), rel=1e-6, abs=1e-9), step


@pytest.mark.parametrize("name", ["momentum", "adamw"])
def test_a_state_converts_to_the_canonical_form_and_back(fw, name):
    opt = load_module("tensorflow", "optimizer")
    o = optim.Optimizer(name)
    weights = init_weights(SEED)
    rng = np.random.default_rng(0)
    arrays = {"step": 7, **{k: rng.normal(size=v.shape).astype(np.float32)
                            for k, v in optim.init_state(o, weights).items() if k != "step"}}
    (device,) = fw.get_devices(1)
    replica = fw.get_params(weights, device)
    state = fw.state_from_numpy(arrays, replica, o)
    back = fw.state_to_numpy(state)
    assert back.keys() == arrays.keys() and back["step"] == 7
    for k in arrays:
        np.testing.assert_array_equal(back[k], arrays[k])
    zeros = fw.state_to_numpy(opt.init_state(replica, o))
    assert zeros["step"] == 0 and all(not v.any() for k, v in zeros.items() if k != "step")


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


@pytest.mark.parametrize("name", ["momentum", "adamw"])
def test_the_stock_port_is_not_the_spec(fw, name, digits):
    """What a straightforward port gets (idiomatic.get_model(..., port="stock")): Keras's conventions, off the spec by
    far more than the parity tolerance, under the parity runs' schedule, weight decay and clipping."""
    from harness.training import Idiomatic, train
    idiomatic = load_module("tensorflow", "idiomatic")
    optimizer = canonical(name, total_steps(digits, 1))
    want, _, _ = spec_run(fw, digits, optimizer, 1)
    runner = Idiomatic(fw, fw.get_devices(1))
    runner.start = lambda weights, o: setattr(runner, "model", idiomatic.get_model(weights, runner.devices, o, "stock"))
    train(runner, digits, EPOCHS, BATCH, optimizer.lr, SEED, optimizer=optimizer)
    got = runner.weights()
    assert max(float(np.max(np.abs(got[k] - want[k]))) for k in want) > 10 * TOLERANCE[name]
