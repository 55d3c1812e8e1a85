"""TensorFlow's bf16 on the wire (tensorflow/data_parallel.py: allreduce, on_the_wire). tf.cast to bf16 and the CPU's
bf16 tf.math.add round to nearest even, so the casts added in device order are common.precision.summed_on_the_wire's
sum to the bit, for any number of devices; add_n's would be up to 9 inputs, and not past them. Every exec level traces
the step per dtype on the wire, so none bakes the other's. Across processes MultiWorkerMirroredStrategy's collective
takes the bf16 tensors as they are: two processes of a device each step as two devices of one process do, to the
bit (tests/test_wire_processes.py)."""
import numpy as np
import pytest

from common import backprop, models, precision
from common.interface import Network, StepSettings
from common.sharding import shard_bounds
from conftest import framework_or_skip
from harness.loader import load_module

LR = 0.1


@pytest.fixture(scope="module")
def fw():
    fw = framework_or_skip("tensorflow")
    fw.get_devices(2)   # the CPU split into logical devices before TensorFlow runs anything
    return fw


def gradients_like(count, seed=0):
    """`count` devices' values of gradients at mixed scales (1e-2 to 1e2), so the sums' roundings fall everywhere."""
    rng = np.random.default_rng(seed)
    return list((rng.standard_normal((count, 50_000)) * rng.choice([1e-2, 1, 1e2], (count, 50_000))).astype(np.float32))


def total_error(moved, want):
    """The moves' distance from the reference's, all parameters at once, relative to its norm (tests/test_precision.py's
    measure)."""
    diff = sum(np.sum((moved[n] - want[n]) ** 2) for n in want)
    return float(np.sqrt(diff / sum(np.sum(np.square(want[n])) for n in want)))


def widened(t):
    import tensorflow as tf
    return tf.cast(t, tf.float32).numpy()


def test_tf_cast_and_add_round_to_nearest_even(fw):
    """Ties go to the even bf16 value (truncation would keep 1 + 2**-7 of 1 + 3 * 2**-8), and on_the_wire's sum of 2,
    3, 4 and 17 devices' values is summed_on_the_wire's, to the bit, where one rounding of their fp32 sum is not."""
    import tensorflow as tf
    data_parallel = load_module("tensorflow", "data_parallel")
    ties = tf.constant([1 + 2 ** -8, 1 + 3 * 2 ** -8], tf.float32)
    assert widened(tf.cast(ties, tf.bfloat16)).tolist() == [1.0, 1 + 2 ** -6]
    for count in (2, 3, 4, 17):
        arrays = gradients_like(count)
        want = precision.summed_on_the_wire(arrays, "bf16")
        total = data_parallel.on_the_wire([tf.constant(a) for a in arrays], "bf16")
        assert total.dtype == tf.bfloat16
        np.testing.assert_array_equal(widened(total), want, err_msg=f"{count} devices")
        once = precision.rounded(np.sum(arrays, axis=0, dtype=np.float64), "bf16")
        assert np.mean(once != want) > 0.2


def test_add_n_adds_in_order_only_up_to_nine_inputs(fw):
    """Why on_the_wire folds tf.math.add: tf.add_n of bf16 tensors is the device-order sum for 9 inputs, and 10
    inputs' sums are another order's (over a tenth of them off)."""
    import tensorflow as tf
    for count, off in ((9, False), (10, True)):
        arrays = gradients_like(count, seed=1)
        got = widened(tf.add_n([tf.cast(a, tf.bfloat16) for a in arrays]))
        assert (np.mean(got != precision.summed_on_the_wire(arrays, "bf16")) > 0.1) == off, count


@pytest.mark.parametrize("level", ["eager", "graph", "xla"])
def test_every_level_steps_by_the_bf16_sum_and_traces_per_dtype(fw, digits, level):
    """The LeNet's step on two devices at each exec level, its units compiled once, at fp32, bf16, then fp32 on the
    wire: bf16's moves the replicas by the reference's bf16 sum (within 1e-4 in norm: measured 3e-6 at every level),
    fp32's twice alike and not by it (2.3e-3 off); a compiled step is traced once per dtype."""
    from harness.training.loop import functional
    model = functional(fw, Network("lenet"))
    settings = StepSettings(units=load_module("tensorflow", "execution").compile(level, model))
    weights = models.init_weights("lenet", 0)
    X, y = digits.X_train[:32], digits.y_train[:32]
    devices = fw.get_devices(2)
    shards = [backprop.loss_and_grads("lenet", weights, None, X[a:b], y[a:b])[1] for a, b in shard_bounds(len(X), 2)]
    want = {n: -LR / len(X) * precision.summed_on_the_wire([g[n] for g in shards], "bf16").astype(np.float64)
            for n in weights}
    moved = []
    for dtype in ("fp32", "bf16", "fp32"):
        replicas = [model.get_params(weights, d) for d in devices]
        fw.train_step(model, replicas, [None, None], X, y, devices, LR,
                      settings=settings._replace(allreduce_dtype=dtype))
        got = model.to_numpy(replicas[0])
        moved.append({n: got[n].astype(np.float64) - weights[n] for n in weights})
    for name in weights:
        np.testing.assert_array_equal(moved[0][name], moved[2][name], err_msg=name)
    assert total_error(moved[1], want) < 1e-4 < 1e-3 < total_error(moved[0], want)
    step = settings.units["step_on_shards"]
    if level != "eager":
        assert step.experimental_get_tracing_count() == 2
