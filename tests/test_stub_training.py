"""The stub worker's runner (tests/stub_training.py) and the studies' runners answer everything the real training loop
asks of a runner: the slow process tests train through them, so a method the loop gains and
they lack fails there, after an hour of CI. Here it fails in a second."""
import inspect

import pytest

from common.data import load_dataset
from harness.spec import RunSpec
from harness.studies.conventions import Stock
from harness.training.loop import Scratch, steps_per_epoch, train
from stub_training import Lockstep


def test_the_stub_runner_trains_through_the_real_loop(tmp_path):
    spec = RunSpec(framework="pytorch", dataset="synthetic", n_synthetic=512, epochs=2, batch_size=128, devices=1,
                   optimizer="sgd")
    data = load_dataset(spec.dataset, spec.data_dir, spec.n_synthetic, spec.seed)
    per_epoch = steps_per_epoch(len(data.y_train), spec.batch_size, spec.devices)
    optimizer = spec.canonical_optimizer(per_epoch)
    runner = Lockstep(0, 1, str(tmp_path))
    record = train(runner, data, spec, optimizer)
    assert runner.steps == 2 * per_epoch == 8
    assert [round(s / n, 6) for s, n in zip(record["epoch_loss_sums"], record["epoch_sizes"])] == [
        round(sum(2.3 * 0.97 ** k for k in range(1, 5)) / 4, 6), round(sum(2.3 * 0.97 ** k for k in range(5, 9)) / 4, 6)]


@pytest.mark.parametrize("runner", [Lockstep, Stock], ids=["stub", "conventions-stock"])
def test_a_runner_standing_in_for_the_loops_takes_the_same_start(runner):
    assert inspect.signature(runner.start).parameters.keys() == inspect.signature(Scratch.start).parameters.keys()
    for name in ("skipped_steps", "scaler_state", "weights", "step", "batches", "feed", "evaluate", "total"):
        assert callable(getattr(runner, name, None)), name
