"""d2l's ResNet-18: the spec (common/resnet.py) against d2l's numbers, each framework's functional forward and its
idiomatic model against the spec's numpy forward, the gradients between frameworks, and the BatchNorm conventions
measured on each framework's own BatchNorm layer. A tiny width and batch keep the file fast."""
import functools

import numpy as np
import pytest

from common import FRAMEWORKS
from common import resnet as spec
from common.layouts import to_canonical
from common.resnet import BN_STATE_NAMES, CANONICAL_BN, PARAM_NAMES, Convention
from conftest import framework_or_skip
from harness.loader import load_module

# Width 8, not 4: PyTorch 2.13's CPU weight gradient of a channels-last 1x1 stride-2 convolution with fewer than 8
# input channels is wrong (and writes past a buffer: later frees abort, or the process hangs), oneDNN's jit_1x1 AVX2
# kernel (uxlfoundation/oneDNN#6035). At width 4, stage 2's projection has 4 input channels.
WIDTH, BATCH = 8, 6
TOL = 1e-4


@pytest.fixture(scope="module")
def case():
    """Weights with non-trivial BatchNorm gamma/beta and biases, a running state away from (0, 1), a batch."""
    rng = np.random.default_rng(0)
    weights = spec.init_weights(0, WIDTH)
    for name in weights:
        if name.endswith("bias") or ".bn" in name:
            weights[name] = (weights[name] + rng.normal(0, 0.2, weights[name].shape)).astype(np.float32)
    state = {name: (rng.normal(0, 0.3, shape) if name.endswith("mean") else rng.uniform(0.5, 2.0, shape))
             .astype(np.float32) for name, shape in spec.bn_state_shapes(WIDTH).items()}
    X = rng.normal(0, 1, (BATCH, *spec.IMAGE_SHAPE)).astype(np.float32)
    y = rng.integers(0, spec.NUM_CLASSES, BATCH)
    return weights, state, X, y


def resnet_of(name):
    fw = framework_or_skip(name)
    return fw, load_module(name, "resnet")


def tensor(name, a):
    if name == "pytorch":
        import torch
        return torch.from_numpy(np.asarray(a))
    if name == "mxnet":
        from mxnet import nd
        return nd.array(a, dtype=np.asarray(a).dtype)
    if name == "tensorflow":
        import tensorflow as tf
        return tf.constant(a)
    import jax.numpy as jnp
    return jnp.asarray(a)


def as_numpy(t):
    if hasattr(t, "detach"):
        t = t.detach()
    return t.asnumpy() if hasattr(t, "asnumpy") else np.asarray(t)


def assert_close(got, want, tol=TOL, what=""):
    """Absolute for values near 1, relative for large ones."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want)))
    assert err <= tol, f"{what}: off by {err:.2e} (tolerance {tol:.0e})"


def assert_state_close(got, want, tol=TOL):
    assert list(got) == list(want)
    for name in want:
        assert_close(got[name], want[name], tol, name)


def differs(got, want, tol=TOL):
    try:
        assert_close(got, want, tol) if not isinstance(want, dict) else assert_state_close(got, want, tol)
    except AssertionError:
        return True
    return False


def layouts(name):
    """The layouts the framework's functional forward runs here (execution.LAYOUTS: lenet.py's, set through its
    `layout`; TensorFlow's NCHW needs oneDNN)."""
    return tuple(load_module(name, "execution").LAYOUTS)


# ---------------------------------------------------------------------------------------------------- the spec
def test_spec_is_d2ls_resnet18():
    shapes = spec.param_shapes(64)
    assert list(shapes) == list(PARAM_NAMES) and len(PARAM_NAMES) == 76   # 37 layers + fc, weight and bias each
    assert len(BN_STATE_NAMES) == 34                                        # 17 BatchNorms: stem + 2 per block
    assert sum(int(np.prod(s)) for s in shapes.values()) == 11_175_818      # d2l's ResNet-18 at 10 classes: 11.2 M
    assert shapes["stem.conv.weight"] == (64, 1, 3, 3) and shapes["fc.weight"] == (10, 512)
    assert shapes["stage2.0.conv3.weight"] == (128, 64, 1, 1) and "stage1.0.conv3.weight" not in shapes
    assert [name for name in shapes if "conv3" in name] == [f"stage{s}.0.conv3.{p}" for s in (2, 3, 4)
                                                            for p in ("weight", "bias")]
    outputs = dict(spec.layer_outputs(64))
    assert [outputs[f"stage{s}.1.conv2"] for s in (1, 2, 3, 4)] == [(64, 28, 28), (128, 14, 14), (256, 7, 7),
                                                                    (512, 4, 4)]
    assert outputs["stage4.0.conv3"] == (512, 4, 4) and outputs["fc"] == (10,)
    assert spec.bn_state_shapes(64)["stage3.1.bn2.running_var"] == (256,)


def test_flops_count_every_convolution():
    def by_hand(w):
        macs = w * 28 * 28 * 9                                             # stem
        macs += 4 * w * 28 * 28 * w * 9                                    # stage 1: four 3x3 convs
        for c, size in ((2 * w, 14), (4 * w, 7), (8 * w, 4)):
            macs += c * size * size * (c // 2 * 9 + 3 * c * 9 + c // 2)    # conv1 from c/2, three c->c, projection
        return 2 * (macs + 10 * 8 * w)
    for w in (4, 64):
        assert spec.flops_per_image(w, training=False) == by_hand(w)
        assert spec.flops_per_image(w) == 3 * by_hand(w)
    assert spec.flops_per_image(64, training=False) == 911_601_664      # 0.46 G multiply-adds per 28x28 image


def test_init_is_seeded_float32_and_scaled():
    a, b, c = spec.init_weights(0, 16), spec.init_weights(0, 16), spec.init_weights(1, 16)
    assert list(a) == list(PARAM_NAMES)
    assert all(a[k].dtype == np.float32 and a[k].shape == spec.param_shapes(16)[k] for k in a)
    assert all((a[k] == b[k]).all() for k in a) and not (a["stem.conv.weight"] == c["stem.conv.weight"]).all()
    assert a["stage3.0.conv2.weight"].std() == pytest.approx(np.sqrt(2 / (64 * 9)), rel=0.05)   # He
    assert (a["stage2.1.bn1.weight"] == 1).all() and not a["stage2.1.bn1.bias"].any() and not a["fc.bias"].any()
    state = spec.init_bn_state(16)
    assert list(state) == list(BN_STATE_NAMES)
    assert not state["stem.bn.running_mean"].any() and (state["stem.bn.running_var"] == 1).all()


def test_shard_moments_combine_into_the_global_batch():
    """--bn sync: per-shard (sum, sum of squares, count), all-reduced, give the global batch's statistics even
    for uneven shards, where averaging the shards' means and variances would not."""
    h = np.random.default_rng(1).normal(2.0, 3.0, (7, 5, 4, 4))
    mean, var, count = spec.combine([spec.moments(shard) for shard in np.array_split(h, 3)])
    assert count == 7 * 16
    np.testing.assert_allclose(mean, h.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(var, h.var(axis=(0, 2, 3)), rtol=1e-10)
    shards = np.array_split(h, 3)
    naive = np.mean([s.var(axis=(0, 2, 3)) for s in shards], axis=0)
    assert not np.allclose(naive, var, rtol=1e-3)


def test_the_convention_table_in_canonical_form():
    assert CANONICAL_BN == Convention(0.1, 1e-5, False)
    assert spec.framework_convention("pytorch") == Convention(0.1, 1e-5, True)
    assert spec.framework_convention("mxnet") == pytest.approx(Convention(0.1, 1e-5, False))
    assert spec.framework_convention("tensorflow") == pytest.approx(Convention(0.01, 1e-3, False))
    assert spec.framework_convention("jax") == pytest.approx(Convention(0.01, 1e-5, False))
    for name in FRAMEWORKS:   # layer_arguments is the inverse, up to the running variance nobody can switch
        got = spec.framework_convention(name, *spec.layer_arguments(name).values())
        assert got == pytest.approx(CANONICAL_BN._replace(unbiased=name == "pytorch"))
    assert spec.layer_arguments("tensorflow") == {"momentum": 0.9, "epsilon": 1e-5}
    assert spec.framework_convention("tensorflow", momentum=0.1).momentum == pytest.approx(0.9)   # the slip


def test_a_convention_slip_changes_the_spec(case):
    weights, state, X, _ = case
    logits, new = spec.forward(weights, state, X, True)
    for slip in (CANONICAL_BN._replace(unbiased=True), CANONICAL_BN._replace(momentum=0.9)):
        other_logits, other = spec.forward(weights, state, X, True, slip)
        np.testing.assert_allclose(other_logits, logits, rtol=1e-12)   # the state differs, not the batch's output
        assert differs(other, new)
    eps = CANONICAL_BN._replace(eps=1e-3)
    assert differs(spec.forward(weights, state, X, True, eps)[0], logits)
    assert differs(spec.forward(weights, new, X, False, eps), spec.forward(weights, new, X, False))


# ------------------------------------------------------------------------------------------ the translations
def compiled(name, forward):
    """JAX's forward under jax.jit (training and the convention static), as its training step will run it: op by
    op, every new shape compiles on its own and the file would take twice as long. The others as written."""
    if name != "jax":
        return forward
    import jax
    return jax.jit(forward, static_argnums=(3, 4))


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_functional_forward_equals_the_spec(name, case):
    fw, module = resnet_of(name)
    weights, state, X, _ = case
    want_logits, want_state = spec.forward(weights, state, X, True)
    want_eval = spec.forward(weights, want_state, X, False)
    device = fw.get_devices(1)[0]
    for layout in layouts(name):
        model = module.Functional(layout=layout)
        params, bn_state = model.get_params(weights, device), model.get_bn_state(state, device)
        assert_state_close(model.to_numpy(params), weights, 0)
        forward = compiled(name, functools.partial(module.forward, layout=model.layout))
        logits, new_state = forward(params, bn_state, tensor(name, X), True)
        assert_close(as_numpy(logits), want_logits, what=f"{layout} training logits")
        assert_state_close(module.bn_state_to_numpy(new_state), want_state)
        assert_state_close(module.bn_state_to_numpy(bn_state), state, 0)   # nothing updated in place
        assert_close(as_numpy(forward(params, new_state, tensor(name, X), False)), want_eval,
                     what=f"{layout} eval logits")


def gradients(name, module, model, params, bn_state, X, y):
    """d(summed cross-entropy of a training-mode forward in model.layout)/d(params), canonical numpy."""
    loss_sum = load_module(name, "lenet").loss_sum
    forward = functools.partial(module.forward, layout=model.layout)
    if name == "pytorch":
        loss_sum(forward(params, bn_state, tensor(name, X), True)[0], tensor(name, y)).backward()
        grads = [p.grad for p in params]
    elif name == "mxnet":
        from mxnet import autograd
        with autograd.record():
            loss = loss_sum(forward(params, bn_state, tensor(name, X), True)[0], tensor(name, y))
        loss.backward()
        grads = [p.grad for p in params]
    elif name == "tensorflow":
        import tensorflow as tf
        with tf.GradientTape() as tape:
            loss = loss_sum(forward(params, bn_state, tensor(name, X), True)[0], tensor(name, y))
        grads = tape.gradient(loss, params)
    else:
        import jax
        loss = lambda ps: loss_sum(forward(ps, bn_state, tensor(name, X), True)[0], y)   # noqa: E731
        grads = jax.jit(jax.grad(loss))(params)   # compiled, as data_parallel.py will (twice as fast here)
    return model.to_numpy(grads)   # canonical, from the layout's kernels


@pytest.fixture(scope="module")
def torch_gradients(case):
    _, module = resnet_of("pytorch")
    weights, state, X, y = case
    model = module.Functional()
    return gradients("pytorch", module, model, model.get_params(weights, "cpu"), model.get_bn_state(state, "cpu"), X, y)


def test_pytorch_gradients_match_finite_differences_of_the_spec(case, torch_gradients):
    weights, state, X, y = case
    loss = lambda w: spec.loss_sum(spec.forward(w, state, X, True)[0], y)   # noqa: E731
    for name, index in [("fc.weight", (3, 17)), ("stem.conv.weight", (1, 0, 1, 2)), ("stem.bn.weight", (2,)),
                        ("stage2.0.conv3.weight", (5, 3, 0, 0)), ("stage3.1.bn2.bias", (9,)),
                        ("stage4.0.conv1.weight", (7, 11, 2, 0))]:
        step = 1e-6   # float64; at 1e-4 some ReLU inputs of this small batch cross zero and the quotient is 2% off
        plus, minus = dict(weights), dict(weights)
        plus[name], minus[name] = weights[name].astype(np.float64), weights[name].astype(np.float64)
        plus[name][index] += step
        minus[name][index] -= step
        numeric = (loss(plus) - loss(minus)) / (2 * step)
        assert torch_gradients[name][index] == pytest.approx(numeric, rel=1e-4, abs=1e-6), name
    # A bias just before a BatchNorm is cancelled by the batch mean: no gradient in training mode.
    assert np.abs(torch_gradients["stage2.1.conv2.bias"]).max() < 1e-5
    assert np.abs(torch_gradients["stage2.0.conv3.bias"]).max() > 1e-3   # the projection's is not


@pytest.mark.parametrize("name", FRAMEWORKS[1:])
def test_gradients_match_pytorch_in_every_layout(name, case, torch_gradients):
    """Every layout the framework runs here: a layout takes other kernels in the backward too (TensorFlow's CPU
    refused an explicitly padded convolution's NCHW backward). PyTorch's ResNet runs NCHW only (pytorch/resnet.py)."""
    fw, module = resnet_of(name)
    weights, state, X, y = case
    device = fw.get_devices(1)[0]
    scale = max(np.abs(g).max() for g in torch_gradients.values())
    for layout in layouts(name):
        model = module.Functional(layout=layout)
        got = gradients(name, module, model, model.get_params(weights, device), model.get_bn_state(state, device), X, y)
        for param in PARAM_NAMES:
            assert_close(got[param] / scale, torch_gradients[param] / scale, what=f"{layout} {param}")


def run_idiomatic(name, model, X, training):
    """One forward of an idiomatic model, in training mode (its BatchNorms update their state) or eval mode."""
    if name == "pytorch":
        import torch
        model.train(training)
        with torch.no_grad():
            return model(tensor(name, X)).numpy()
    if name == "mxnet":   # Gluon's BatchNorm moves its running statistics in the backward pass
        from mxnet import autograd
        with autograd.record(train_mode=training):
            out = model(tensor(name, X))
        if training:
            out.backward()
        return out.asnumpy()
    if name == "tensorflow":
        return model(tensor(name, X), training=training).numpy()
    from flax import nnx
    model.train() if training else model.eval()
    return np.asarray(nnx.jit(lambda model, X: model(X))(model, tensor(name, X)))   # nnx.jit: the state moves too


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_idiomatic_model_equals_the_spec(name, case):
    """Configured to the canonical convention, each framework's own layers give the spec's step; PyTorch's keeps
    its unbiased running variance, which no argument changes, and measurably misses the canonical state."""
    _, module = resnet_of(name)
    weights, state, X, _ = case
    model = module.build_model(weights, state)
    assert_state_close(module.model_to_numpy(model)[1], state, 0)
    actual = spec.framework_convention(name, *spec.layer_arguments(name).values())
    want_logits, want_state = spec.forward(weights, state, X, True, actual)
    assert_close(run_idiomatic(name, model, X, True), want_logits, what="training logits")
    got_weights, got_state = module.model_to_numpy(model)
    assert_state_close(got_weights, weights, 0)
    assert_state_close(got_state, want_state)
    assert differs(got_state, spec.forward(weights, state, X, True, actual._replace(unbiased=not actual.unbiased))[1])
    assert differs(got_state, spec.forward(weights, state, X, True)[1]) == (name == "pytorch")
    assert_close(run_idiomatic(name, model, X, False), spec.forward(weights, want_state, X, False), what="eval")
    assert_state_close(module.model_to_numpy(model)[1], got_state, 0)   # eval mode leaves the state alone


@functools.cache
def late_op(seconds):
    """The name of an MXNet custom operator that passes its input on `seconds` after it starts (registered once)."""
    import time
    import mxnet as mx

    class Late(mx.operator.CustomOp):
        def forward(self, is_train, req, in_data, out_data, aux):
            time.sleep(seconds)
            self.assign(out_data[0], req[0], in_data[0])

    class LateProp(mx.operator.CustomOpProp):
        def create_operator(self, ctx, shapes, dtypes):
            return Late()

    mx.operator.register(f"late{seconds}")(LateProp)
    return f"late{seconds}"


def late_in_mxnet(array, seconds):
    """`array`, ready `seconds` later in MXNet's engine: what depends on it waits, a read that does not depend on it
    does not."""
    from mxnet import nd
    return nd.Custom(array, op_type=late_op(seconds))


def test_gluon_static_shape_lets_a_read_of_the_running_statistics_overtake_their_update(case):
    """Why mxnet/resnet.py hybridizes without static_shape: with it, MXNet 1.9.1's engine does not order a read of
    a BatchNorm's running statistics (running_mean.data(), what model_to_numpy and a checkpoint read) after the
    backward pass that moves them, so the read races the update and may see the old values. Read right after an
    unordered backward, 26 to 34 of the 34 were old here, and none when other tests ran first: a race. Made
    certain with a backward held back by half a second (its head gradient a late op): with static_shape the read
    returns at once with old values (all 34 here); without, it waits for the backward and reads every moved one. The
    gradients are ordered either way (a read waits for them), which is why lenet.py, with no running statistics,
    keeps static_shape."""
    framework_or_skip("mxnet")
    from mxnet import autograd, nd
    module = load_module("mxnet", "resnet")
    weights, state, X, _ = case
    new_state = spec.forward(weights, state, X, True)[1]
    for static_shape in (True, False):
        net = module.build_model(weights, state, static_shape=static_shape)
        with autograd.record(train_mode=True):
            out = net(tensor("mxnet", X))
        out.backward(late_in_mxnet(nd.ones_like(out), 0.5))
        read = module.model_to_numpy(net)[1]
        parameters = module.gluon_parameters(net)
        gradients = {name: parameters[name].grad().asnumpy() for name in PARAM_NAMES}
        nd.waitall()
        old = [name for name, value in new_state.items() if differs(read[name], value)]
        assert bool(old) == static_shape, (static_shape, old)   # some read old, or every one waited for
        for name, gradient in gradients.items():                 # the gradients waited for, either way
            assert np.array_equal(gradient, parameters[name].grad().asnumpy()), name
        assert any(np.abs(g).max() > 0 for g in gradients.values())
        assert_state_close(module.model_to_numpy(net)[1], new_state)   # the update did happen
        assert_close(run_idiomatic("mxnet", net, X, False), spec.forward(weights, new_state, X, False))   # and is used


def test_stock_gluon_code_hybridized_with_static_shape_saves_its_running_statistics_right_after_waitall(tmp_path):
    """What that race does to a user's checkpoint: stock Gluon code (a HybridSequential with a BatchNorm, hybridized
    with static_alloc and static_shape for speed, a Trainer) that calls save_parameters right
    after its last step writes the weights of that step but running statistics older than the net's (made certain by
    holding the last backward back; in a plain loop, saved at once, a step or more behind here, or their initial
    values); after mx.nd.waitall(), or hybridized without static_shape, the file holds the net's own."""
    framework_or_skip("mxnet")
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    rng = np.random.default_rng(0)
    X, y = nd.array(rng.normal(size=(16, 1, 12, 12))), nd.array(rng.integers(0, 10, 16))
    behind = {}
    for static_shape, wait in [(True, False), (True, True), (False, False)]:
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(6, 5), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"), gluon.nn.Dense(10))
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=True, static_shape=static_shape)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        for step in range(3):
            with autograd.record():
                loss = loss_fn(net(X), y)
            loss.backward(late_in_mxnet(nd.ones_like(loss), 0.5) if step == 2 else None)
            trainer.step(len(X))
        if wait:
            nd.waitall()
        net.save_parameters(str(tmp_path / "net.params"))
        nd.waitall()
        in_file = nd.load(str(tmp_path / "net.params"))
        in_net = {name: p.data().asnumpy() for name, p in net._collect_params_with_prefix().items()}
        behind[static_shape, wait] = sorted(k for k, v in in_file.items() if not np.array_equal(v.asnumpy(), in_net[k]))
    assert behind == {(True, False): ["1.running_mean", "1.running_var"], (True, True): [], (False, False): []}, behind


def test_gluon_saves_the_mean_of_its_contexts_running_statistics(tmp_path):
    """A Gluon BatchNorm trained on several contexts without SyncBatchNorm keeps a set of running statistics per
    context (each from its own shard); save_parameters writes their mean (Parameter._reduce), which load_parameters
    gives every context. For equal shards that is the whole batch's running mean, but a running variance short of
    the whole batch's by the shards' means' spread: one step from (0, 1), biased variance, momentum 0.9."""
    framework_or_skip("mxnet")
    import mxnet as mx
    from mxnet import autograd, gluon
    contexts = [mx.cpu(0), mx.cpu(1)]
    h = np.random.default_rng(3).normal(size=(8, 3, 2, 2)).astype(np.float32)
    h[4:] += 3.0   # the second context's shard sits elsewhere
    layer = gluon.nn.BatchNorm(in_channels=3)
    layer.initialize(ctx=contexts)
    with autograd.record():
        outs = [layer(x) for x in gluon.utils.split_and_load(mx.nd.array(h), contexts)]
    autograd.backward(outs)
    shards = [h[:4], h[4:]]
    means = [x.mean(axis=(0, 2, 3)) for x in shards]
    variances = [x.var(axis=(0, 2, 3)) for x in shards]
    for i, ctx in enumerate(contexts):   # each context's own
        np.testing.assert_allclose(layer.running_mean.data(ctx).asnumpy(), 0.1 * means[i], rtol=1e-5)
        np.testing.assert_allclose(layer.running_var.data(ctx).asnumpy(), 0.9 + 0.1 * variances[i], rtol=1e-5)
    layer.save_parameters(str(tmp_path / "bn.params"))
    saved = {k: v.asnumpy() for k, v in mx.nd.load(str(tmp_path / "bn.params")).items()}
    np.testing.assert_allclose(saved["running_mean"], 0.1 * h.mean(axis=(0, 2, 3)), rtol=1e-5)   # the whole batch's
    np.testing.assert_allclose(saved["running_var"], 0.9 + 0.1 * np.mean(variances, axis=0), rtol=1e-5)
    spread = np.var(means, axis=0)   # what the whole batch's variance has besides the shards' mean variance
    np.testing.assert_allclose(h.var(axis=(0, 2, 3)), np.mean(variances, axis=0) + spread, rtol=1e-5)
    assert np.all(0.1 * spread > 0.05)   # so the saved running variance is visibly not the whole batch's
    again = gluon.nn.BatchNorm(in_channels=3)
    again.load_parameters(str(tmp_path / "bn.params"), ctx=contexts)
    for ctx in contexts:
        np.testing.assert_array_equal(again.running_var.data(ctx).asnumpy(), saved["running_var"])


# ------------------------------------------------- each framework's own BatchNorm layer, one training step
def native_layer_step(name, h, mean, var, backward=True, **arguments):
    """One training-mode step of `name`'s own BatchNorm layer (gamma 1, beta 0) on NCHW h, running statistics
    starting at (mean, var): (output NCHW, new running mean, new running var), numpy. `backward`: MXNet's step
    includes the backward pass (the others' forward is the whole step for the statistics)."""
    c = h.shape[1]
    if name == "pytorch":
        import torch
        layer = torch.nn.BatchNorm2d(c, **arguments)
        layer.running_mean.copy_(torch.from_numpy(mean))
        layer.running_var.copy_(torch.from_numpy(var))
        with torch.no_grad():
            out = layer.train()(torch.from_numpy(h))
        return out.numpy(), layer.running_mean.numpy(), layer.running_var.numpy()
    if name == "mxnet":
        from mxnet import autograd, gluon, nd
        layer = gluon.nn.BatchNorm(in_channels=c, **arguments)
        layer.initialize()
        layer.running_mean.set_data(nd.array(mean))
        layer.running_var.set_data(nd.array(var))
        with autograd.record(train_mode=True):
            out = layer(nd.array(h))
        if backward:
            out.backward()   # the running statistics move here, not in the forward
        return out.asnumpy(), layer.running_mean.data().asnumpy(), layer.running_var.data().asnumpy()
    if name == "tensorflow":
        import tensorflow as tf
        layer = tf.keras.layers.BatchNormalization(**arguments)
        layer.build((None, *h.shape[2:], c))
        layer.moving_mean.assign(mean)
        layer.moving_variance.assign(var)
        out = layer(tf.constant(h.transpose(0, 2, 3, 1)), training=True).numpy().transpose(0, 3, 1, 2)
        return out, layer.moving_mean.numpy(), layer.moving_variance.numpy()
    import jax.numpy as jnp
    from flax import nnx
    layer = nnx.BatchNorm(c, **arguments, rngs=nnx.Rngs(0))
    layer.mean.value, layer.var.value = jnp.asarray(mean), jnp.asarray(var)
    out = np.asarray(layer(jnp.asarray(h.transpose(0, 2, 3, 1)))).transpose(0, 3, 1, 2)
    return out, np.asarray(layer.mean.value), np.asarray(layer.var.value)


@pytest.fixture(scope="module")
def small_batch():
    """2 images of 3 channels at 2x2: n = 8 values per channel, so the unbiased variance is 8/7 of the biased."""
    rng = np.random.default_rng(2)
    h = rng.normal(1.0, 2.0, (2, 3, 2, 2)).astype(np.float32)
    return h, rng.normal(0, 1, 3).astype(np.float32), rng.uniform(0.5, 2, 3).astype(np.float32)


def spec_step(h, mean, var, bn):
    c = h.shape[1]
    return spec.batch_norm(h, np.ones(c), np.zeros(c), mean, var, True, bn)


def assert_step(got, want, tol=1e-5):
    for what, g, w in zip(("output", "running mean", "running var"), got, want):
        assert_close(g, w, tol, what)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_each_frameworks_own_batchnorm_follows_its_table_row(name, small_batch):
    """The table's running-variance entry, measured: the layer at its defaults matches the spec under the row's
    convention and fails it with the other variance."""
    framework_or_skip(name)
    h, mean, var = small_batch
    row = spec.framework_convention(name)
    got = native_layer_step(name, h, mean, var)
    assert_step(got, spec_step(h, mean, var, row))
    assert differs(got[2], spec_step(h, mean, var, row._replace(unbiased=not row.unbiased))[2], 1e-5)


def test_gluon_batchnorm_moves_its_statistics_in_the_backward_pass(small_batch):
    """The table's `updates` for MXNet: a training-mode forward alone leaves the running statistics as they were."""
    framework_or_skip("mxnet")
    assert spec.BN_LAYERS_BY_FRAMEWORK["mxnet"]["updates"] == "backward"
    h, mean, var = small_batch
    _, new_mean, new_var = native_layer_step("mxnet", h, mean, var, backward=False)
    np.testing.assert_array_equal(new_mean, mean)
    np.testing.assert_array_equal(new_var, var)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_layer_arguments_give_the_canonical_convention_and_raw_values_do_not(name, small_batch):
    """layer_arguments(name) translates the canonical convention into the layer's own words; PyTorch's numbers
    passed as they are (momentum 0.1, eps 1e-5) are a slip everywhere its momentum weighs the running value."""
    framework_or_skip(name)
    h, mean, var = small_batch
    canonical = spec_step(h, mean, var, CANONICAL_BN._replace(unbiased=name == "pytorch"))
    assert_step(native_layer_step(name, h, mean, var, **spec.layer_arguments(name)), canonical)
    raw = dict(zip(spec.layer_arguments(name), (0.1, 1e-5)))
    slipped = native_layer_step(name, h, mean, var, **raw)
    if name == "pytorch":
        assert_step(slipped, canonical)
    else:
        assert differs(slipped[1], canonical[1], 1e-5)
    if name == "tensorflow":   # Keras's default epsilon, 1e-3, changes the output itself
        momentum = spec.layer_arguments(name)["momentum"]
        assert differs(native_layer_step(name, h, mean, var, momentum=momentum)[0], canonical[0], 1e-5)
