"""Gradient accumulation in the scratch step (--accumulate K): each device's shard cut into K micro-batches
(common.sharding.micro_batches), their gradients added up on the device, one all-reduce per update. For the LeNet
that is the big batch's step, to float32 round-off, with a stateful optimizer too; and the all-reduce runs once per
update, not K times (counted)."""
import pytest

from common.lenet import PARAM_NAMES
from common.optim import Optimizer
from common.sharding import micro_batch_count, micro_batches
from conftest import framework_or_skip
from harness.loader import load_module
from harness.spec import RunSpec

# A whole epoch of digits: 14 batches of 97 rows (on 2 devices shards of 49 and 48, micro-batches of 13, 12, 12, 12)
# and a last one of 79, which a traced step meets with a new shape (TensorFlow's retrace: sizes unknown in the graph)
BATCH, SEED, STEPS = 97, 5, 15
# Momentum's default rate: at 0.05 the loss spikes at step 12, where the accumulated run's round-off (2.5e-6 in the
# loss) grows to 1e-3, and shrinks back after
LR = 0.02
TOL = 1e-5
# Adam divides each gradient by its own size: where the true gradient is near 0 the round-off of a reordered sum
# becomes a step (measured after the epoch: 1.3e-5 to 2.5e-5 in the four frameworks; the losses stay within 1e-5).
WEIGHT_TOL = {"adamw": 1e-4}


def test_every_device_cuts_its_shard_into_the_same_number_of_micro_batches():
    assert micro_batch_count(97, 2, 4) == 4
    assert micro_batch_count(5, 2, 4) == 2      # an epoch's last batch: shards of 3 and 2, so 2 micro-batches each
    assert micro_batch_count(1, 1, 4) == 1
    assert micro_batches(49, 4) == [(0, 13), (13, 25), (25, 37), (37, 49)]


def spec(framework, devices, accumulate, name, exec_="default"):
    return RunSpec(framework=framework, devices=devices, accumulate=accumulate, dataset="digits", epochs=1,
                   batch_size=BATCH, lr=LR, seed=SEED, threads=1, optimizer=name, exec=exec_)


def optimizer(name):
    return Optimizer(name, LR, weight_decay=1e-2 if name == "adamw" else 5e-4, total_steps=STEPS)


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
    call them once, at its trace): one per parameter, as without accumulation, not 4."""
    from harness.training.loop import train
    framework_or_skip(framework)
    data_parallel = load_module(framework, "data_parallel")
    counted = []
    real = data_parallel.allreduce
    monkeypatch.setattr(data_parallel, "allreduce", lambda *args: counted.append(1) or real(*args))
    run = spec(framework, 2, 4, "sgd", "eager").replace(max_steps=1)
    train(scratch_runners(run), digits, run, Optimizer(lr=0.05))
    assert len(counted) == len(PARAM_NAMES)   # each of the LeNet's parameters summed once


@pytest.mark.parametrize("accumulate", [4])
def test_ddp_accumulates_under_no_sync_and_all_reduces_once_per_update(accumulate, digits, gloo_group):
    """PyTorch's built-in engine, DistributedDataParallel (a process group of this one process): the micro-batches'
    backward under no_sync but the last, so DDP all-reduces its bucket once per update (counted by a comm hook), and
    the steps are the unaccumulated engine's."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from harness.training.loop import Hooks, runner as runner_for, train
    fw = framework_or_skip("pytorch")
    records, weights, calls = {}, {}, {}
    for k in (1, accumulate):
        run = spec("pytorch", 1, k, "momentum").replace(mode="builtin")
        runner, counted = runner_for(run, fw, fw.get_devices(1)), []

        def count_all_reduces(steps, runner):
            if steps == 0:
                runner.model.net.register_comm_hook(None, lambda group, bucket: counted.append(1) or allreduce_hook(
                    group, bucket))
        records[k] = train(runner, digits, run, optimizer("momentum"), hooks=Hooks(before_step=count_all_reduces))
        weights[k], calls[k] = runner.weights(), len(counted)
    want = [s / n for s, n in zip(records[1]["step_loss_sums"], records[1]["step_sizes"])]
    got = [s / n for s, n in zip(records[accumulate]["step_loss_sums"], records[accumulate]["step_sizes"])]
    assert got == pytest.approx(want, abs=TOL)
    for key, value in weights[1].items():
        assert abs(weights[accumulate][key] - value).max() <= TOL, key
    assert calls[accumulate] == calls[1] == STEPS, calls   # the LeNet fits one bucket: one all-reduce a step


def test_gluon_accumulates_with_grad_req_add_and_sums_each_key_once_per_update(digits):
    """MXNet's built-in engine, a Trainer over 2 contexts: the Parameters' grad_req 'add', each micro-batch's backward
    adding into .grad, one trainer.step per update, whose kvstore sums each parameter's key once (counted), and the
    steps are the unaccumulated engine's."""
    from harness.training.loop import Hooks, runner as runner_for, train
    fw = framework_or_skip("mxnet")
    records, weights, calls = {}, {}, {}
    for k in (1, 4):
        run = spec("mxnet", 2, k, "momentum").replace(mode="builtin")
        runner, counted = runner_for(run, fw, fw.get_devices(2)), []

        def count_sums(steps, runner):
            if steps == 0:
                kvstore = runner.model.trainer._kvstore
                pushpull = kvstore.pushpull
                kvstore.pushpull = lambda *args, **kwargs: counted.append(1) or pushpull(*args, **kwargs)
        records[k] = train(runner, digits, run, optimizer("momentum"), hooks=Hooks(before_step=count_sums))
        weights[k], calls[k] = runner.weights(), len(counted)
    want = [s / n for s, n in zip(records[1]["step_loss_sums"], records[1]["step_sizes"])]
    got = [s / n for s, n in zip(records[4]["step_loss_sums"], records[4]["step_sizes"])]
    assert got == pytest.approx(want, abs=TOL)
    for key, value in weights[1].items():
        assert abs(weights[4][key] - value).max() <= TOL, key
    assert calls[4] == calls[1] == STEPS * len(PARAM_NAMES), calls


def test_the_option_is_a_row_each_and_a_column_of_the_table():
    import compare
    from harness.run.plan import row_label, run_specs
    from harness.publishing.tables import format_table
    rows = list(run_specs(compare.parse_args(["--frameworks", "pytorch,tensorflow", "--mode", "scratch,builtin",
                                              "--accumulate", "1,4"])))
    reasons = {(s.framework, s.mode, s.accumulate): reason for s, reason in rows}
    assert len(reasons) == 8 and [key for key, reason in reasons.items() if reason] == [("tensorflow", "builtin", 4)]
    assert "Keras's gradient_accumulation_steps" in reasons["tensorflow", "builtin", 4]
    assert row_label(rows[2][0]) == "pytorch scratch (default, accumulate 4), 2 device(s), 1 process(es)"
    run = {"framework": "jax", "mode": "scratch", "devices": 2, "processes": 1, "epochs": 1, "status": "ok"}
    assert "accumulate" not in format_table([{**run, "accumulate": 1}])
    table = format_table([{**run, "accumulate": 1}, {**run, "accumulate": 4}]).splitlines()
    assert [line.split("|")[5].strip() for line in table] == ["accumulate", "-" * 12, "1", "4"]
