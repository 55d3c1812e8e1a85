"""JAX's own data parallelism in both of its forms, and the shard_map gradient trap they must avoid."""
import numpy as np
import pytest

from harness.loader import load_module
from common.lenet import init_weights
from conftest import framework_or_skip, replicas_of, train_steps, weights_of


@pytest.fixture(scope="module")
def jax_fw():
    return framework_or_skip("jax")


SHAPES = [(1, 97), (2, 97), (3, 101), (4, 64)]   # (devices, batch): uneven shards but the last
# The fast tier keeps one device of each form and shard_map's three (uneven shards, the padding masked); the others
# repeat those cases at a compile of seconds a shape (jit's three and shard_map's four: conftest.SLOW_REPEATS)
SLOW = {"jit": {(2, 97), (4, 64)}, "shard_map": {(2, 97)}}
FORMS = [pytest.param(form, n, batch, marks=(pytest.mark.slow,) if (n, batch) in SLOW[form] else ())
         for form in ("jit", "shard_map") for n, batch in SHAPES]


@pytest.mark.parametrize("form,n_devices,batch_size", FORMS)
def test_both_builtin_forms_compute_the_scratch_step(jax_fw, digits, form, n_devices, batch_size):
    """jit + NamedSharding (XLA inserts the all-reduce) and shard_map + psum (written by hand) give the
    recipe's step, uneven shards included (the global array is padded, the padding masked)."""
    builtin, pipeline = load_module("jax", "builtin"), load_module("jax", "pipeline")
    devices = jax_fw.get_devices(n_devices)
    X, y = digits.X_train[:batch_size], digits.y_train[:batch_size]
    replicas = replicas_of(jax_fw, init_weights(1), devices)
    ref_loss = train_steps(jax_fw, replicas, X, y, devices, 0.2)
    model = builtin.get_model(init_weights(1), devices, form=form)
    for _ in range(2):   # twice: the second step starts from the first one's replicated update
        loss = builtin.train_step(model, pipeline.global_batch(model.placement, devices, X, y, batch_size), 0.2, batch_size)
        if _ == 0:
            assert loss == pytest.approx(ref_loss, abs=1e-5)
            weights, ref = builtin.to_numpy(model), weights_of(jax_fw, replicas[0])
            for name in ref:
                np.testing.assert_allclose(weights[name], ref[name], atol=1e-5, err_msg=name)
    for p in model.net:   # every device holds the same, updated parameters
        shards = [np.asarray(s.data) for s in p.addressable_shards]
        assert len(shards) == n_devices and all(np.array_equal(s, shards[0]) for s in shards)


@pytest.mark.parametrize("cap", [None, 25 * 2**20, 4 * 3000])
def test_the_bucketed_builtin_step_makes_one_psum_a_bucket_and_the_same_step(jax_fw, digits, cap):
    """--allreduce bucketed (get_model's bucket_bytes): XLA's CPU compiler leaves one all-reduce per gradient (8 for the LeNet, in
    both forms), so the shard_map form flattens them, one psum per bucket of common/buckets.py's plan (one at 25 MiB,
    five at 12 KB: the convolutions together, the dense layers' weights alone). Same step; the psums counted in the
    compiled program."""
    import jax.numpy as jnp
    from common.buckets import plan
    from common.lenet import PARAM_NAMES
    builtin, pipeline = load_module("jax", "builtin"), load_module("jax", "pipeline")
    devices = jax_fw.get_devices(2)
    X, y = digits.X_train[:97], digits.y_train[:97]
    model = builtin.get_model(init_weights(1), devices, form=None if cap else "shard_map",   # bucketed: shard_map
                              bucket_bytes=cap)
    batch = pipeline.global_batch(model.placement, devices, X, y, 97)
    hlo = model.trainer.lower(model.net, *batch[:3], jnp.float32(0.2 / 97)).compile().as_text()
    sizes = [p.size for p in model.net]
    assert hlo.count(" all-reduce(") == (len(PARAM_NAMES) if cap is None else len(plan(sizes, cap)))
    reference = builtin.get_model(init_weights(1), devices, form="jit")
    labelled = model if cap else reference   # the row's label: the form get_model chose for the harness
    assert builtin.EXEC(labelled) == ("jax.jit+shard_map" if cap else "jax.jit+NamedSharding")
    losses = [[builtin.train_step(m, batch, 0.2, 97) for _ in range(2)] for m in (model, reference)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and losses[0][1] < losses[0][0]
    weights, ref = builtin.to_numpy(model), builtin.to_numpy(reference)
    for name in ref:
        np.testing.assert_allclose(weights[name], ref[name], atol=1e-6, err_msg=name)


def test_the_shard_map_gradient_trap_is_real(jax_fw):
    """The reason for lax.pvary in builtin.py: shard_map's gradient of a replicated input is already summed
    over the mesh, so a psum on top doubles it. If JAX changes this, builtin.py's comment must change too."""
    import jax
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax_fw.get_devices(2)), ("devices",))
    x = jax.numpy.arange(4.0)   # rows 0, 1 on device 0 and 2, 3 on device 1

    def summed_grad(mark_varying):
        def per_device(w, x):
            g = jax.grad(lambda w: (w * x).sum())(lax.pvary(w, "devices") if mark_varying else w)
            return lax.psum(g, "devices")
        return float(jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("devices")),
                                           out_specs=P(), check_vma=True))(1.0, x))
    assert summed_grad(mark_varying=True) == 6.0    # d/dw sum(w * x) = sum(x)
    assert summed_grad(mark_varying=False) == 12.0  # counted twice



def test_the_engine_s_synchronised_batchnorm_takes_the_global_batch_s_statistics_under_shard_map(jax_fw):
    """jax/resnet.py's BatchNorm with an axis_name, on 2 devices of 49 and 48 real rows (the second padded): its
    running statistics are those of the 97 rows' batch (float64), and the gradients of the devices' summed losses,
    the input's through the psum'd statistics included, are one device's with nnx.BatchNorm over the whole batch.
    Flax's own axis_name, which pmeans each device's mean, is off: only summed counts give the global batch's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec as P
    resnet = load_module("jax", "resnet")
    devices = jax_fw.get_devices(2)
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(0.0, 1.0, (49, 3, 3, 4)), rng.normal(2.0, 3.0, (49, 3, 3, 4))]).astype(np.float32)
    W = rng.normal(0.0, 1.0, X.shape).astype(np.float32)   # the loss: the outputs weighed, so every gradient shows
    mask = np.arange(98) != 97   # the last row pads the second device's 48 to 49
    real = X[mask].astype(np.float64)
    mesh = Mesh(np.array(devices), ("devices",))

    def layer(kind, **extra):
        return kind(4, momentum=0.0, use_fast_variance=False, rngs=nnx.Rngs(0), **extra)

    def run(kind):
        """The layer's new running statistics, and the gradients of the real rows' loss by its scale and bias
        (summed over the devices) and by the input (each device its rows)."""
        graphdef, params, stats = nnx.split(layer(kind, axis_name="devices"), nnx.Param, nnx.BatchStat)

        def per_device(params, stats, X, W, mask):
            def loss(params, X):
                model = nnx.merge(graphdef, params, stats, copy=True)
                kept = mask.reshape(-1, 1, 1, 1)
                return jnp.sum(model(X, mask=kept) * W * kept), nnx.state(model, nnx.BatchStat)
            (_, new), (by_params, by_X) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
                jax.lax.pvary(params, "devices"), X)
            return new, jax.lax.psum(by_params, "devices"), by_X
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("devices"), P("devices"),
                                                                     P("devices")),
                                     out_specs=(P(), P(), P("devices"))))(params, stats, X, W, mask)

    new, by_params, by_X = run(resnet.BatchNorm)
    np.testing.assert_allclose(np.asarray(new["mean"].value), real.mean(axis=(0, 1, 2)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["var"].value), real.var(axis=(0, 1, 2)), rtol=1e-5)
    whole = layer(nnx.BatchNorm)
    want_params, want_X = nnx.grad(lambda m, X: jnp.sum(m(X) * W[mask]), argnums=(0, 1))(whole, jnp.asarray(X[mask]))
    for name in ("scale", "bias"):
        np.testing.assert_allclose(np.asarray(by_params[name].value), np.asarray(want_params[name].value),
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(by_X)[mask], np.asarray(want_X), rtol=1e-4, atol=1e-5)
    flax_s, _, _ = run(nnx.BatchNorm)
    assert np.max(np.abs(np.asarray(flax_s["mean"].value) - real.mean(axis=(0, 1, 2)))) > 1e-3
