"""TensorFlow at --precision fp16, beyond tests/test_loss_scaling.py's contract: the scratch step and Keras really
compute in fp16, the bias gradient is summed where TensorFlow's CPU kernels sum fp16 in fp32, a skipped step changes
no optimizer state (the scratch step's and Keras's LossScaleOptimizer's, whose schedule counts `iterations`), the
scale is the compiled step's argument, and what Keras's LossScaleOptimizer does under MirroredStrategy that
builtin.py works around. And what both low precisions meet in TensorFlow's CPU kernels: the ResNet's convolutions
kept off oneDNN's crashing 1x1 stride-2 backward, fp16 in NCHW refused in one line where no kernel runs it."""
import dataclasses

import numpy as np
import pytest

from common import models, optim
from common.interface import Network, RosettaError, StepSettings, Unavailable
from common.layouts import to_channels_last
from common.loss_scaling import LossScaling, Scaler
from conftest import framework_or_skip, scratch
from harness.loader import load_module

OVERFLOW = 2.0 ** 40   # a loss scale at which the fp16 backward overflows on any batch
FINITE = 2.0 ** 6      # one at which the LeNet's does not


@pytest.fixture(scope="module")
def fw():
    fw = framework_or_skip("tensorflow")
    fw.get_devices(2)   # the CPU split into logical devices before TensorFlow runs anything
    return fw


def test_the_scratch_step_and_keras_compute_in_fp16(fw, digits):
    """The scratch LeNet's logits and the Keras LeNet's convolution outputs are float16 (the CPU has fp16 kernels);
    every weight gradient of the scratch step is an fp16 value widened to fp32 for its master weight."""
    import tensorflow as tf
    lenet, idiomatic = load_module("tensorflow", "lenet"), load_module("tensorflow", "idiomatic")
    weights, device = models.init_weights("lenet", 0), fw.get_devices(1)[0]
    model, _ = scratch("tensorflow", precision="fp16")
    replica = model.get_params(weights, device)
    X, y = digits.X_train[:16], digits.y_train[:16]
    assert lenet.forward(replica, tf.constant(X), precision="fp16").dtype == tf.float16
    _, grads, _ = model.loss_and_grads([replica], [None], fw.split_and_load(X, [device]),
                                       fw.split_and_load(y, [device]), [device], tf.constant(FINITE))
    for name, g in model.to_numpy([tf.Variable(g) for g in grads[0]]).items():
        assert g.dtype == np.float32 and np.array_equal(g.astype(np.float16).astype(np.float32), g), name
    net = idiomatic.build(weights, Network("lenet", None, False, "fp16"))
    convs = [layer for layer in net.layers if isinstance(layer, tf.keras.layers.Conv2D)]
    assert [layer.compute_dtype for layer in convs] == ["float16"] * 2
    assert {v.dtype for v in net.trainable_variables} == {"float32"}
    assert tf.keras.Model(net.inputs[0], convs[0].output)(X).dtype == tf.float16


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_bias_gradient_is_one_rounding_of_its_fp32_sum(fw, precision):
    """lenet.bias_add's bias gradient is the exact sum rounded once; the other way (BIAS_SUMS_IN_FP32) sums in the
    low precision: tf.nn.bias_add's BiasAddGrad at bf16, the broadcast's tf.reduce_sum at fp16, both over 10 times
    the rounding's error on a 16x24x24 batch."""
    import tensorflow as tf
    lenet = load_module("tensorflow", "lenet")
    dtype = lenet.COMPUTE_DTYPES[precision]
    rng = np.random.default_rng(0)
    h, dy = (tf.cast(rng.standard_normal((16, 24, 24, 20)).astype(np.float32), dtype) for _ in range(2))
    b = tf.cast(rng.standard_normal(20).astype(np.float32), dtype)
    exact = tf.reduce_sum(tf.cast(dy, tf.float64), [0, 1, 2]).numpy()

    def error(add):
        with tf.GradientTape() as tape:
            tape.watch(b)
            out = add(h, b)
        got = tf.cast(tape.gradient(out, b, dy), tf.float64).numpy()
        return np.linalg.norm(got - exact) / np.linalg.norm(exact)
    rounding = np.linalg.norm(tf.cast(tf.cast(exact, dtype), tf.float64).numpy() - exact) / np.linalg.norm(exact)
    chosen = error(lambda h, b: lenet.bias_add(h, b, precision=precision))
    other = error(lambda h, b: lenet.bias_add(h, b, precision="bf16" if precision == "fp16" else "fp16"))
    assert chosen == pytest.approx(rounding, rel=1e-3)
    assert other > 10 * rounding


@pytest.mark.parametrize("precision,layout", [("bf16", "nhwc"), ("bf16", "nchw"), ("fp16", "nhwc")])
def test_the_resnet_s_low_precision_convolutions_give_onednn_no_1x1_stride_2_backward(fw, precision, layout):
    """Every convolution of the scratch ResNet with its gradients, traced at the low precisions ("VALID" after a
    tf.pad: oneDNN's kernels, where fp32's explicit padding keeps the backward in Eigen's): no Conv2D or its backward
    has a 1x1 filter and a stride above 1 (TensorFlow 2.21's oneDNN backward for one corrupts the heap:
    resnet.subsampled), and a projection computes what its stride-2 convolution would, to the bit."""
    import tensorflow as tf
    resnet, lenet = load_module("tensorflow", "resnet"), load_module("tensorflow", "lenet")
    weights = models.init_weights("resnet18", 0)
    rng = np.random.default_rng(0)
    for name, (kernel, stride, _) in resnet.CONVS.items():
        p = {f"{name}.{part}": tf.constant(to_channels_last(f"{name}.{part}", weights[f"{name}.{part}"]))
             for part in ("weight", "bias")}
        c_in = weights[f"{name}.weight"].shape[1]
        h = tf.constant(rng.standard_normal((3, 14, 14, c_in) if layout == "nhwc" else (3, c_in, 14, 14)), tf.float32)

        @tf.function(autograph=False)
        def forward_and_back(h, p):
            with tf.GradientTape() as tape:
                tape.watch([h, *p.values()])
                out = resnet.conv(p, name, h, layout, precision)
            return out, tape.gradient(out, [h, *p.values()])
        for op in forward_and_back.get_concrete_function(h, p).graph.get_operations():
            if op.type.startswith("Conv2D"):
                filter_shape = (op.outputs[0] if op.type == "Conv2DBackpropFilter" else op.inputs[1]).shape
                assert not (tuple(filter_shape[:2]) == (1, 1) and max(op.get_attr("strides")) > 1), (name, op.type)
        if kernel == 1 and stride > 1:
            x, w, b = lenet.compute(precision, h, p[f"{name}.weight"], p[f"{name}.bias"])
            want = lenet.bias_add(tf.nn.conv2d(x, w, stride, "VALID", data_format=layout.upper()), b, layout.upper(),
                                  precision)
            np.testing.assert_array_equal(tf.cast(forward_and_back(h, p)[0], tf.float32).numpy(),
                                          tf.cast(want, tf.float32).numpy())


def test_fp16_in_nchw_is_one_line_where_tensorflow_cannot_convolve_it(fw):
    """fp16 with --layout nchw: both networks' Functionals where TensorFlow here convolves fp16 in NCHW, else one
    Unavailable line (on the AMD EPYC the step failed with a graph's InvalidArgumentError); the other layouts and
    precisions are untouched."""
    lenet, resnet = load_module("tensorflow", "lenet"), load_module("tensorflow", "resnet")
    assert lenet.Functional("nhwc", "fp16").layout == "nhwc"
    assert resnet.Functional("nchw", precision="bf16").layout == "nchw"
    if lenet.runs_fp16_in_nchw():
        assert lenet.Functional("nchw", "fp16").layout == resnet.Functional("nchw", precision="fp16").layout == "nchw"
        return
    import tensorflow as tf
    with pytest.raises((tf.errors.UnimplementedError, tf.errors.InvalidArgumentError)):   # what the step met
        tf.function(lambda: tf.nn.conv2d(tf.ones((2, 1, 6, 6), tf.float16), tf.ones((3, 3, 1, 2), tf.float16), 1,
                                         "VALID", data_format="NCHW"))()
    for make in (lambda: lenet.Functional("nchw", "fp16"), lambda: resnet.Functional("nchw", precision="fp16")):
        with pytest.raises(Unavailable, match="no fp16 convolution in NCHW on this CPU"):
            make()


def adam():
    return optim.Optimizer("adam", 1e-3, schedule="cosine", total_steps=10)


def first_batch(digits, n=32):
    return digits.X_train[:n], digits.y_train[:n]


def test_a_skipped_scratch_step_changes_no_optimizer_state_and_the_scale_is_the_step_s_argument(fw, digits):
    """At a scale where the fp16 backward overflows the scratch step (the compiled default level) assigns nothing:
    weights, Adam's buffers and step count as they were, the scale halved; a finite step then updates them. Three
    scales, one trace of the compiled step."""
    model, settings = scratch("tensorflow", precision="fp16")
    devices = fw.get_devices(2)
    weights = models.init_weights("lenet", 0)
    replicas = [model.get_params(weights, d) for d in devices]
    states = [fw.init_state(r, adam()) for r in replicas]
    X, y = first_batch(digits)
    step = settings.units["step_on_shards"]
    traces = []
    for scaler in (Scaler(LossScaling(OVERFLOW, 2)), Scaler(LossScaling(FINITE, 2))):
        loss = fw.train_step(model, replicas, [None, None], X, y, devices, 1e-3, None, states,
                             settings._replace(scaler=scaler))
        traces.append(step.experimental_get_tracing_count())
        assert np.isfinite(loss)   # the losses returned are unscaled, from the forward in fp16
        if scaler.config.initial == OVERFLOW:
            assert scaler.scale == OVERFLOW / 2
            state = fw.state_to_numpy(states[0], model)
            assert state["step"] == 0 and all(not np.any(v) for k, v in state.items() if k != "step")
            assert all(np.array_equal(model.to_numpy(r)[n], weights[n]) for r in replicas for n in weights)
        else:
            assert scaler.scale == FINITE and scaler.good_steps == 1
            assert [fw.state_to_numpy(s, model)["step"] for s in states] == [1, 1]
            assert not np.array_equal(model.to_numpy(replicas[0])["fc2.bias"], weights["fc2.bias"])
    assert traces[0] == traces[1]


@pytest.mark.parametrize("mode", ["idiomatic", "builtin"])
def test_a_skipped_keras_step_changes_no_optimizer_state(fw, digits, mode):
    """Keras's LossScaleOptimizer skips an overflowing step without calling its inner optimizer: the weights, Adam's
    buffers and `iterations` (the step count its cosine schedule is at, which it hands on as its own) stay; only
    the scale halves. A finite step then advances iterations to 1."""
    engine = load_module("tensorflow", mode)
    devices = fw.get_devices(1 if mode == "idiomatic" else 2)
    weights = models.init_weights("lenet", 0)
    for initial, steps in ((OVERFLOW, 0), (FINITE, 1)):
        model = engine.get_model(weights, devices, adam(), network=Network(
            "lenet", None, False, "fp16", LossScaling(initial, 2)))
        run_one_step(fw, engine, model, mode, devices, digits)
        state = engine.optimizer_state(model)
        assert state["step"] == steps
        assert int(model.trainer.iterations.numpy()) == steps
        assert engine.scaler_state(model).scale == (initial / 2 if steps == 0 else initial)
        if steps == 0:
            assert all(not np.any(v) for k, v in state.items() if k != "step")
            assert all(np.array_equal(v, weights[k]) for k, v in engine.to_numpy(model).items())


def run_one_step(fw, engine, model, mode, devices, data):
    """One train_step of the engine on the first batch of `data` (the built-in engine's through its pipeline)."""
    X, y = first_batch(data)
    if mode == "idiomatic":
        return engine.train_step(model, X, y, devices, 1e-3, len(X))
    pipeline = load_module("tensorflow", "pipeline")
    loader = pipeline.make_loader(data, batch_order(data, len(X), devices), 0, 1, model, devices)
    return engine.train_step(model, next(pipeline.batches(loader, 0)), 1e-3, len(X))


def batch_order(data, batch_size, devices):
    """The run's order of the training set (epoch 0 as the harness deals it), batches of batch_size."""
    from common.batches import Order
    return Order(len(data.y_train), batch_size, 0, len(devices))


def test_keras_loss_scale_optimizer_takes_only_other_factors_as_an_error(fw):
    """Its factors are 2 and 0.5 in its code, with no ceiling and no delay: a LossScaling asking otherwise is one
    line of RosettaError."""
    idiomatic = load_module("tensorflow", "idiomatic")
    for scaling in (LossScaling(8.0, 2, growth_factor=4.0), LossScaling(8.0, 2, maximum=2.0 ** 24),
                    LossScaling(8.0, 2, late=True)):
        with pytest.raises(RosettaError) as err:
            idiomatic.get_model(models.init_weights("lenet", 0), fw.get_devices(1),
                                network=Network("lenet", None, False, "fp16", scaling))
        assert "\n" not in str(err.value)


def test_keras_loss_scale_optimizer_checks_the_first_replica_s_unsummed_gradients(fw):
    """Keras 3's LossScaleOptimizer under MirroredStrategy on the CPU (a strategy that merges) decides the step is
    finite from the first replica's gradients before they are summed (its inner optimizer sums them later, inside
    the update): a non-finite gradient on the second replica alone is applied (an inf weight) and counted as a
    finite step. Why builtin.py sums the gradients before the LossScaleOptimizer sees them."""
    import tensorflow as tf
    devices = fw.get_devices(2)
    strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice(devices[0]))
    with strategy.scope():
        w = tf.Variable([1.0, 2.0])
        trainer = tf.keras.optimizers.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1), initial_scale=8.0)
        trainer.build([w])

    @tf.function
    def step(first, second):
        def replica_step():
            ctx = tf.distribute.get_replica_context()
            g = tf.cond(tf.equal(ctx.replica_id_in_sync_group, 0), lambda: first, lambda: second)
            trainer.apply_gradients([(g, w)])
        strategy.run(replica_step)
    step(tf.constant([np.inf, 8.0]), tf.constant([8.0, 8.0]))   # on the first replica: skipped
    assert float(trainer.dynamic_scale.numpy()) == 4.0 and w.numpy().tolist() == [1.0, 2.0]
    step(tf.constant([8.0, 8.0]), tf.constant([np.inf, 8.0]))   # on the second: applied
    assert float(trainer.dynamic_scale.numpy()) == 4.0 and not np.isfinite(w.numpy()[0])


def test_the_builtin_engine_skips_a_step_whose_second_replica_overflows(fw, digits):
    """builtin.py sums the replicas' gradients before the LossScaleOptimizer checks them: an image of inf on the
    second replica's shard only (its gradients nan) skips the step on both replicas, the scale halved."""
    builtin = load_module("tensorflow", "builtin")
    devices = fw.get_devices(2)
    weights = models.init_weights("lenet", 0)
    X = digits.X_train.copy()
    X[batch_order(digits, 32, devices).parts(0, 0, 1)[0][0][-1]] = np.inf   # the first batch's last row
    data = dataclasses.replace(digits, X_train=X)
    model = builtin.get_model(weights, devices, network=Network("lenet", None, False, "fp16", LossScaling(FINITE, 2)))
    run_one_step(fw, builtin, model, "builtin", devices, data)
    assert builtin.scaler_state(model).scale == FINITE / 2
    assert all(np.array_equal(v, weights[k]) for k, v in builtin.to_numpy(model).items())


def test_every_scratch_level_runs_the_scaled_step_alike(fw, digits):
    """eager, tf.function and tf.function+XLA: the same skip, the same scale, losses within fp16's bound."""
    from common.precision import BOUND
    devices = fw.get_devices(2)
    X, y = first_batch(digits)
    results = {}
    for level in ("eager", "graph", "xla"):
        model, settings = scratch("tensorflow", level=level, precision="fp16")
        replicas = [model.get_params(models.init_weights("lenet", 0), d) for d in devices]
        scaler = Scaler(LossScaling(FINITE * 2, 2))
        losses = [fw.train_step(model, replicas, [None, None], X, y, devices, 0.1, None, None,
                                StepSettings(settings.bucket_bytes, settings.units, 1, scaler)) for _ in range(2)]
        results[level] = losses, scaler.scale
    for level, (losses, scale) in results.items():
        assert scale == results["eager"][1], level
        assert losses == pytest.approx(results["eager"][0], rel=BOUND["fp16"]), level
