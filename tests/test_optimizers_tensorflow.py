"""TensorFlow's optimizer.py beyond the parity runs: the Keras schedule gives the spec's rate at every step, states
convert to the canonical form and back, Keras 3's own global_clipnorm clips each replica's shard under
MirroredStrategy (why builtin.py sums the gradients before the trainer sees them), and the stock port is not the
spec."""
import numpy as np
import pytest

from common import optim
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
