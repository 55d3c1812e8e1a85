"""Gradient accumulation (--accumulate K) in the scratch step and in every built-in engine: each device's shard cut
into K micro-batches (common.sharding.micro_batches), their gradients added up on the device, one all-reduce per
update. For the LeNet that is the big batch's step, to float32 round-off, with a stateful optimizer too; the
all-reduce runs once per update, not K times (counted in each engine its own way); and for the ResNet, whose
BatchNorm sees each micro-batch alone, the engines take the scratch step's micro-batches."""
import numpy as np
import pytest

from common.lenet import PARAM_NAMES
from common.optim import Optimizer
from common.sharding import micro_batch_count, micro_batches
from conftest import framework_or_skip
from harness.loader import load_module
from harness.spec import RunSpec

# A whole epoch of digits: 14 batches of 97 rows (on 2 devices shards of 49 and 48, micro-batches of 13, 12, 12, 12)
# and a last one of 79, which a traced step meets with a new shape (TensorFlow's retrace: sizes unknown in the graph).
# The engines' epochs are short_digits' (tests/conftest.py): 3 batches of 97 and the last of 79.
BATCH, SEED, STEPS, SHORT_STEPS = 97, 5, 15, 4
# Momentum's default rate: at 0.05 the loss spikes at step 12, where the accumulated run's round-off (2.5e-6 in the
# loss) grows to 1e-3, and shrinks back after
LR = 0.02
TOL = 1e-5
# Adam divides each gradient by its own size: where the true gradient is near 0 the round-off of a reordered sum
# becomes a step (measured after the epoch: 1.3e-5 to 2.5e-5 in the four frameworks; the losses stay within 1e-5).
# After the first four steps alone up to 6.9e-4, before later gradients outweigh the round-off: hence the whole epoch.
WEIGHT_TOL = {"adamw": 1e-4}


def test_every_device_cuts_its_shard_into_the_same_number_of_micro_batches():
    assert micro_batch_count(97, 2, 4) == 4
    assert micro_batch_count(5, 2, 4) == 2      # an epoch's last batch: shards of 3 and 2, so 2 micro-batches each
    assert micro_batch_count(1, 1, 4) == 1
    assert micro_batches(49, 4) == [(0, 13), (13, 25), (25, 37), (37, 49)]


def spec(framework, devices, accumulate, name, exec_="default"):
    return RunSpec(framework=framework, devices=devices, accumulate=accumulate, dataset="digits", epochs=1,
                   batch_size=BATCH, lr=LR, seed=SEED, threads=1, optimizer=name, exec=exec_)


def optimizer(name, steps=STEPS):
    return Optimizer(name, LR, weight_decay=1e-2 if name == "adamw" else 5e-4, total_steps=steps)


CASES = [(2, 4, "adamw"), pytest.param(1, 2, "momentum", marks=pytest.mark.slow),
         pytest.param(2, 2, "momentum", marks=pytest.mark.slow)]


@pytest.mark.parametrize("devices,accumulate,name", CASES)
@pytest.mark.parametrize("framework", ["pytorch", "mxnet", "tensorflow", "jax"])
def test_accumulated_micro_batches_are_the_big_batch_s_step(framework, devices, accumulate, name, recipe_runs):
    framework_or_skip(framework)
    want_weights, _, want = recipe_runs(spec(framework, devices, 1, name), optimizer(name))
    got_weights, _, got = recipe_runs(spec(framework, devices, accumulate, name), optimizer(name))
    losses = [s / n for s, n in zip(got["step_loss_sums"], got["step_sizes"])]
    assert losses == pytest.approx([s / n for s, n in zip(want["step_loss_sums"], want["step_sizes"])], abs=TOL)
    for key, value in want_weights.items():
        assert abs(got_weights[key] - value).max() <= WEIGHT_TOL.get(name, TOL), key


@pytest.mark.parametrize("framework", ["pytorch", "mxnet", "tensorflow", "jax"])
def test_one_all_reduce_per_update_not_one_per_micro_batch(framework, digits, scratch_runners, monkeypatch):
    """The scratch step's all-reduces counted over a step of 4 micro-batches, op by op (eager: a traced step would
    call them once, at its trace; JAX's default level too, whose jax.jit compiles each device's forward and backward
    and the update but runs the all-reduce as written, without eager JAX's compile of every op of the step): one per
    parameter, as without accumulation, not 4."""
    from harness.training.loop import train
    framework_or_skip(framework)
    data_parallel = load_module(framework, "data_parallel")
    counted = []
    real = data_parallel.allreduce
    monkeypatch.setattr(data_parallel, "allreduce", lambda *args: counted.append(1) or real(*args))
    run = spec(framework, 2, 4, "sgd", "default" if framework == "jax" else "eager").replace(max_steps=1)
    train(scratch_runners(run), digits, run, Optimizer(lr=0.05))
    assert len(counted) == len(PARAM_NAMES)   # each of the LeNet's parameters summed once


def engine_epochs(framework, devices, data, install_counter, mode="builtin"):
    """An engine's epoch of `data` (the built-in or, with mode, the idiomatic) with K = 1 and 4 (momentum): its steps
    with accumulation are the unaccumulated engine's (losses within TOL, the weights after the epoch too), and
    install_counter(runner, counted), called before the first step, counts the engine's collectives into the list
    `counted`: their number per K comes back."""
    from harness.training.loop import Hooks, runner as runner_for, train
    fw = framework_or_skip(framework)
    losses, weights, counts = {}, {}, {}
    for k in (1, 4):
        run = spec(framework, devices, k, "momentum").replace(mode=mode)
        runner, counted = runner_for(run, fw, fw.get_devices(devices)), []

        def before_step(steps, runner):
            if steps == 0:
                install_counter(runner, counted)
        record = train(runner, data, run, optimizer("momentum", SHORT_STEPS), hooks=Hooks(before_step=before_step))
        losses[k] = [s / n for s, n in zip(record["step_loss_sums"], record["step_sizes"])]
        weights[k], counts[k] = runner.weights(), len(counted)
    assert losses[4] == pytest.approx(losses[1], abs=TOL)
    for key, value in weights[1].items():
        assert abs(weights[4][key] - value).max() <= TOL, key
    return counts


def test_ddp_accumulates_under_no_sync_and_all_reduces_once_per_update(short_digits, gloo_group):
    """PyTorch's built-in engine, DistributedDataParallel (a process group of this one process): the micro-batches'
    backward under no_sync but the last, so DDP all-reduces its bucket once per update (counted by a comm hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def count_all_reduces(runner, counted):
        runner.model.net.register_comm_hook(None, lambda group, bucket: counted.append(1) or allreduce_hook(
            group, bucket))
    counts = engine_epochs("pytorch", 1, short_digits, count_all_reduces)
    assert counts[4] == counts[1] == SHORT_STEPS, counts   # the LeNet fits one bucket: one all-reduce a step


@pytest.mark.slow   # the ResNet's six steps
def test_ddp_broadcasts_rank_0_s_running_statistics_once_per_update_not_per_micro_batch(digits, gloo_group):
    """DDP's broadcast_buffers sends rank 0's BatchNorm running statistics before a forward, but a forward under
    no_sync turns the next one's off (torch/nn/parallel/distributed.py: _post_forward sets require_forward_param_sync
    False): accumulating, the statistics go out once per update, before its first micro-batch, as without
    accumulation. Counted on the ResNet in a process group of one."""
    from harness.training.loop import Hooks, runner as runner_for, train
    fw = framework_or_skip("pytorch")
    calls = {}
    for k in (1, 4):
        run = RunSpec(framework="pytorch", model="resnet18", width=8, devices=1, accumulate=k, mode="builtin",
                      dataset="digits", epochs=1, batch_size=BATCH, lr=0.1, seed=SEED, threads=1, max_steps=3)
        runner, counted = runner_for(run, fw, fw.get_devices(1)), []

        def count_broadcasts(steps, runner):
            if steps == 0:
                net = runner.model.net
                broadcast = net._sync_buffers
                net._sync_buffers = lambda: counted.append(1) or broadcast()
        train(runner, digits, run, Optimizer(lr=0.1), hooks=Hooks(before_step=count_broadcasts))
        calls[k] = len(counted)
    assert calls[1] == calls[4] == 3, calls


def test_gluon_accumulates_with_grad_req_add_and_sums_each_key_once_per_update(short_digits):
    """MXNet's built-in engine, a Trainer over 2 contexts: the Parameters' grad_req 'add', each micro-batch's backward
    adding into .grad, one trainer.step per update, whose kvstore sums each parameter's key once (counted)."""
    def count_sums(runner, counted):
        kvstore = runner.model.trainer._kvstore
        pushpull = kvstore.pushpull
        kvstore.pushpull = lambda *args, **kwargs: counted.append(1) or pushpull(*args, **kwargs)
    counts = engine_epochs("mxnet", 2, short_digits, count_sums)
    assert counts[4] == counts[1] == SHORT_STEPS * len(PARAM_NAMES), counts


def test_tf_distribute_accumulates_in_the_replica_step_and_all_reduces_once_per_update(short_digits, monkeypatch):
    """TensorFlow's built-in engine, MirroredStrategy over 2 devices: each replica's micro-batches in the traced step
    (the loop unrolled), their gradients added up on the replica, one all-reduce per update. Counted as the step is
    traced: the replica context's all_reduce calls, the same with K = 4 as without (each is in the graph once, so
    one all-reduce per micro-batch would count 4 times as many)."""
    import tensorflow as tf
    real = tf.distribute.ReplicaContext.all_reduce

    def count_all_reduces(runner, counted):
        monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce",
                            lambda *args, **kwargs: counted.append(1) or real(*args, **kwargs))
    counts = engine_epochs("tensorflow", 2, short_digits, count_all_reduces)
    assert counts[4] == counts[1] > 0, counts


def test_keras_s_own_gradient_accumulation_cannot_run_under_mirrored_strategy_in_a_tf_function():
    """Why TensorFlow's engine accumulates in its replica step rather than with Keras's gradient_accumulation_steps:
    Keras applies the update inside a cond, and the all-reduce in it is a merge_call, which MirroredStrategy refuses
    in a tf.function (keras-team/keras 17429). The day a Keras release runs it, this fails and the docs change."""
    devices = framework_or_skip("tensorflow").get_devices(2)
    import tensorflow as tf
    strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice(devices[0]))
    with strategy.scope():
        w = tf.Variable([1.0, 2.0])
        trainer = tf.keras.optimizers.SGD(learning_rate=0.1, gradient_accumulation_steps=2)
        trainer.build([w])

    @tf.function
    def step():
        return strategy.run(lambda: trainer.apply_gradients([(tf.ones_like(w), w)]))
    with pytest.raises(RuntimeError, match="merge_call"):
        step()


def test_jax_s_compiled_step_accumulates_on_each_device_and_all_reduces_once_per_update(short_digits):
    """JAX's built-in engine: each device's micro-batches in the compiled step (shard_map's form, the loop unrolled),
    their gradients added up on the device, one psum per update. Counted in the compiled program of an update: the
    same all-reduces with K = 4 as without, one per parameter (under jit XLA would all-reduce each micro-batch's
    gradient: its CPU compiler combines none)."""
    import jax.numpy as jnp
    pipeline = load_module("jax", "pipeline")

    def count_all_reduces(runner, counted):
        model = runner.model
        batch = pipeline.global_batch(model.placement, runner.devices, short_digits.X_train[:BATCH],
                                      short_digits.y_train[:BATCH], BATCH)
        state = () if model.trainer.opt_state is None else (model.trainer.opt_state,)
        hlo = model.trainer.lower(model.net, *state, *batch[:3], jnp.float32(1 / BATCH),
                                  count=runner.micro_batches(BATCH, runner.accumulate)).compile().as_text()
        counted += [1] * hlo.count(" all-reduce(")
    counts = engine_epochs("jax", 2, short_digits, count_all_reduces)
    assert counts[4] == counts[1] == len(PARAM_NAMES), counts


@pytest.mark.parametrize("framework", ["pytorch", "mxnet", pytest.param("tensorflow", marks=pytest.mark.slow),
                                       pytest.param("jax", marks=pytest.mark.slow)])   # 10 s each: two compiled steps
def test_the_idiomatic_loops_accumulate_as_their_tutorials_do(framework, short_digits):
    """The single-device loops: PyTorch's backward per micro-batch adding into .grad, one optimizer.step; Gluon's
    grad_req 'add', one trainer.step, zero_grad; Keras's and Flax's gradients added up in the compiled step before
    the one update. Their steps are the whole batch's."""
    engine_epochs(framework, 1, short_digits, lambda runner, counted: None, mode="idiomatic")


# The ResNet's engines against the scratch step, both accumulating: one step (tests/test_resnet_engines.py's TOL: a
# ResNet's float32 round-off moves a weight by ~1e-4 in a step). Measured, relative: the losses within 1.8e-6, the
# weights within 3e-7 (JAX), 2.9e-4 (TensorFlow) and 3.6e-4 (MXNet). Cutting each device's padded shard instead of its
# real rows (49 and 48) moves the BatchNorm's micro-batches: JAX's first loss 1.6e-3 off.
RESNET_TOL = 1e-3


@pytest.mark.slow   # a ResNet's compiled step each: 20 to 40 s
@pytest.mark.parametrize("framework,bn", [("jax", "sync"), ("jax", "local"), ("tensorflow", "sync"),
                                          ("mxnet", "local")])
def test_an_engine_s_accumulated_resnet_step_is_the_scratch_step_s(framework, bn, digits, recipe_runs):
    """Under accumulation the BatchNorm normalises each micro-batch by its own statistics (local: one device's
    micro-batch; sync: the same micro-batch of every device), and its running statistics move once per micro-batch.
    The engines do what the scratch step does: the same first step, losses, weights and running statistics."""
    from harness.training.loop import runner as runner_for, train
    fw = framework_or_skip(framework)
    run = RunSpec(framework=framework, model="resnet18", width=8, bn=bn, devices=2, accumulate=2, dataset="digits",
                  epochs=1, batch_size=BATCH, lr=0.1, seed=SEED, threads=1, max_steps=1, optimizer="momentum",
                  exec="default" if framework == "jax" else "eager")   # one step: the faster of tracing and dispatch
    momentum = Optimizer("momentum", 0.1, weight_decay=0.05, total_steps=1)
    want_weights, want_states, want = recipe_runs(run, momentum)
    engine = run.replace(mode="builtin", exec="default")
    runner = runner_for(engine, fw, fw.get_devices(2))
    got = train(runner, digits, engine, momentum)
    assert got["step_loss_sums"] == pytest.approx(want["step_loss_sums"], rel=1e-5)
    for got_arrays, want_arrays in [(runner.weights(), want_weights), *zip(runner.replica_bn_states(), want_states)]:
        for name, value in want_arrays.items():
            assert np.max(np.abs(got_arrays[name] - value) / np.maximum(1.0, np.abs(value))) <= RESNET_TOL, name


def test_the_option_is_a_row_each_and_a_column_of_the_table():
    import compare
    from harness.run.plan import row_label, run_specs
    from harness.publishing.tables import format_table
    rows = list(run_specs(compare.parse_args(["--frameworks", "pytorch,tensorflow", "--mode", "scratch,builtin",
                                              "--accumulate", "1,4"])))
    reasons = {(s.framework, s.mode, s.accumulate): reason for s, reason in rows}
    assert len(reasons) == 8 and not any(reasons.values())   # every framework's scratch step and engine accumulate
    idiomatic = dict(run_specs(compare.parse_args(["--mode", "idiomatic", "--devices", "1", "--accumulate", "1,2"])))
    assert len(idiomatic) == 8 and not any(idiomatic.values())
    assert row_label(rows[2][0]) == "pytorch scratch (default, accumulate 4), 2 device(s), 1 process(es)"
    run = {"framework": "jax", "mode": "scratch", "devices": 2, "processes": 1, "epochs": 1, "status": "ok"}
    assert "accumulate" not in format_table([{**run, "accumulate": 1}])
    table = format_table([{**run, "accumulate": 1}, {**run, "accumulate": 4}]).splitlines()
    assert [line.split("|")[5].strip() for line in table] == ["accumulate", "-" * 12, "1", "4"]
