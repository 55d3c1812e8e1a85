"""JAX's bf16 on the wire. The scratch step (jax/data_parallel.py: allreduce) casts each device's gradients to bf16
and adds them eagerly in device order: XLA's CPU adds bf16 in fp32 and rounds to nearest even, which is
common.precision.summed_on_the_wire's sum to the bit, for any number of devices. The engine (jax/builtin.py) casts
around shard_map's psum; XLA's CPU sums a bf16 all-reduce in fp32 (its all-reduce-promotion pass), and with its excess
precision allowed the f32->bf16->f32 pairs that leaves are dropped (the wire then carries fp32's sum): the step is
compiled without it (execution.compiler_options). Two devices' engine step then equals the scratch step's to the bit.
jit's form, whose all-reduces XLA places inside the batch sums, refuses bf16 on the wire."""
import re

import numpy as np
import pytest

from common import models, precision
from common.interface import Unavailable
from conftest import framework_or_skip, scratch
from harness.loader import load_module

LR = 0.1


@pytest.fixture(scope="module")
def jax_fw():
    fw = framework_or_skip("jax")
    fw.get_devices(4)   # the CPU split into devices before JAX runs anything
    return fw


def gradients_like(count, seed=0):
    """`count` devices' values of gradients at mixed scales (1e-2 to 1e2), so the sums' roundings fall everywhere."""
    rng = np.random.default_rng(seed)
    return list((rng.standard_normal((count, 50_000)) * rng.choice([1e-2, 1, 1e2], (count, 50_000))).astype(np.float32))


def test_eager_bf16_casts_and_adds_round_to_nearest_even(jax_fw):
    """Ties go to the even bf16 value, and allreduce's sum of 2, 3 and 4 devices' values is summed_on_the_wire's, to
    the bit, where one rounding of their sum is not."""
    import jax.numpy as jnp
    data_parallel = load_module("jax", "data_parallel")
    ties = jnp.array([1 + 2 ** -8, 1 + 3 * 2 ** -8], jnp.float32)
    assert np.asarray(ties.astype(jnp.bfloat16).astype(jnp.float32)).tolist() == [1.0, 1 + 2 ** -6]
    devices = jax_fw.get_devices(4)
    for count in (2, 3, 4):
        arrays = gradients_like(count)
        want = precision.summed_on_the_wire(arrays, "bf16")
        summed = data_parallel.allreduce([jax_fw.split_and_load(a, [d])[0] for a, d in zip(arrays, devices)], "bf16")
        for total in summed:
            assert total.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(total), want, err_msg=f"{count} devices")
        once = precision.rounded(np.sum(arrays, axis=0, dtype=np.float64), "bf16")
        assert np.mean(once != want) > 0.2


def engine_step(jax_fw, weights, X, y, dtype, bucket_bytes=None):
    """The engine's LeNet after one step on two devices with `dtype` on the wire, and its model."""
    builtin, pipeline = load_module("jax", "builtin"), load_module("jax", "pipeline")
    devices = jax_fw.get_devices(2)
    extra = {} if dtype == "fp32" else {"allreduce_dtype": dtype}
    model = builtin.get_model(weights, devices, form="shard_map", bucket_bytes=bucket_bytes, **extra)
    builtin.train_step(model, pipeline.global_batch(model.placement, devices, X, y, len(X)), LR, len(X))
    return builtin.to_numpy(model), model


def scratch_step(jax_fw, weights, X, y, dtype):
    model, settings = scratch("jax")
    devices = jax_fw.get_devices(2)
    replicas = [model.get_params(weights, d) for d in devices]
    jax_fw.train_step(model, replicas, [None, None], X, y, devices, LR,
                      settings=settings._replace(allreduce_dtype=dtype))
    return model.to_numpy(replicas[0])


@pytest.mark.parametrize("bucket_bytes", [None, 2 ** 16])
def test_the_engine_s_bf16_step_is_the_scratch_step_s(jax_fw, digits, bucket_bytes):
    """shard_map's step with bf16 on the wire, per tensor and by buckets, moves the weights as the scratch step's with
    bf16 on the wire, to the bit (97 rows: 49 and 48 a device), and not as its own fp32 step."""
    weights = models.init_weights("lenet", 0)
    X, y = digits.X_train[:97], digits.y_train[:97]
    want = scratch_step(jax_fw, weights, X, y, "bf16")
    got, _ = engine_step(jax_fw, weights, X, y, "bf16", bucket_bytes)
    fp32, _ = engine_step(jax_fw, weights, X, y, "fp32", bucket_bytes)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert any(not np.array_equal(fp32[n], got[n]) for n in want)


def test_a_bf16_psum_is_summed_in_fp32_between_two_roundings(jax_fw):
    """XLA's CPU promotes a bf16 psum to an fp32 all-reduce between converts: the psum of two devices' casts is
    summed_on_the_wire's to the bit (one addition rounded once), with excess precision off (the engine's option) and,
    in JAX 0.7.1's XLA, allowed too: the converts around the all-reduce are kept either way (a guard that costs
    nothing)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax_fw.get_devices(2)), ("devices",))
    arrays = np.stack(gradients_like(2))
    want = precision.summed_on_the_wire(list(arrays), "bf16")
    for excess in (False, True):
        psum = jax.jit(jax.shard_map(lambda x: lax.psum(x[0].astype(jnp.bfloat16), "devices").astype(jnp.float32)[None],
                                     mesh=mesh, in_specs=P("devices"), out_specs=P("devices")),
                       compiler_options={"xla_allow_excess_precision": excess})
        np.testing.assert_array_equal(np.asarray(psum(arrays))[0], want, err_msg=f"excess precision {excess}")
        assert re.search(r"= f32\[50000\]\{0\} all-reduce\(", psum.lower(arrays).compile().as_text())


def test_the_engine_s_all_reduces_take_bf16_roundings(jax_fw, digits):
    """The LeNet's compiled bf16-on-the-wire step: its 8 psums (one per tensor) are fp32 all-reduces (promoted), each
    fed by a fusion that rounds to bf16 (convert_convert's round trip, or a transpose's copy with it)."""
    import jax.numpy as jnp
    X, y = digits.X_train[:32], digits.y_train[:32]
    _, model = engine_step(jax_fw, models.init_weights("lenet", 0), X, y, "bf16")
    batch = load_module("jax", "pipeline").global_batch(model.placement, jax_fw.get_devices(2), X, y, len(X))
    hlo = model.trainer.lower(model.net, *batch[:3], jnp.float32(LR / len(X))).compile().as_text()
    reduces = re.findall(r"= f32\[[\d,]*\]\{[\d,]*\} all-reduce\(%(\S+?)\),.*to_apply=%(\S+?),", hlo)
    assert len(reduces) == 8 and all(region.endswith("_promoted") for _, region in reduces), reduces
    for source, _ in reduces:   # the instruction that feeds it, through the computations it calls: a bf16 convert
        assert re.search(r"bf16\[[\d,]*\]\{?[\d,]*\}? convert\(", called_text(hlo, source)), source


def called_text(hlo, instruction):
    """The HLO text of `instruction`'s line and of every computation it calls (a fusion's, a parallel call's)."""
    (line,) = re.findall(rf"%{re.escape(instruction)} = [^\n]*", hlo)
    text = line
    for name in re.findall(r"(?:calls|to_apply)=%([\w.-]+)", line):
        body = hlo[hlo.index(f"%{name} ("):]
        body = body[:body.index("\n}")]
        text += body + "".join(called_text(hlo, i) for i in re.findall(r"%([\w.-]+) = [^\n]*(?:calls|to_apply)=", body))
    return text


def test_jit_s_form_refuses_bf16_on_the_wire(jax_fw):
    builtin = load_module("jax", "builtin")
    with pytest.raises(Unavailable, match="shard_map"):
        builtin.get_model(models.init_weights("lenet", 0), jax_fw.get_devices(2), form="jit", allreduce_dtype="bf16")
