"""--target-accuracy: the test accuracy after every epoch, evaluated outside the timers, and the training seconds
until it first reached the target: the time to accuracy."""
import json

import pytest

from conftest import run_compare as compare
from harness.publishing.tables import format_table
from harness.training.loop import time_to_accuracy


def test_the_seconds_are_the_epochs_up_to_the_first_one_at_the_target():
    seconds, accuracies = [3.0, 2.0, 2.5, 2.0], [0.5, 0.84, 0.86, 0.85]
    assert time_to_accuracy(seconds, accuracies, 0.85) == {"target_accuracy": 0.85, "seconds_to_target": 7.5,
                                                           "epochs_to_target": 3}
    assert time_to_accuracy(seconds, accuracies, 0.5)["seconds_to_target"] == 3.0
    assert time_to_accuracy(seconds, accuracies, 0.9) == {"target_accuracy": 0.9, "seconds_to_target": None,
                                                          "epochs_to_target": None}
    assert time_to_accuracy(seconds, accuracies, None) == {}
    # resumed after 3 epochs: the same accuracies are epochs 4 to 7, the seconds the resumed run's own
    assert time_to_accuracy(seconds, accuracies, 0.85, first_epoch=3)["epochs_to_target"] == 6


def test_the_table_says_how_long_or_that_it_never_got_there():
    rows = [{"framework": f, "mode": "scratch", "devices": 1, "processes": 1, "epochs": 4, "status": "ok",
             "target_accuracy": 0.85, **reached} for f, reached in
            (("pytorch", {"seconds_to_target": 7.46, "epochs_to_target": 3}),
             ("mxnet", {"seconds_to_target": None, "epochs_to_target": None}))]
    for timing in (False, True):
        lines = format_table(rows, timing=timing).splitlines()
        at = [c.strip() for c in lines[0].split("|")].index("s to 0.85 acc")
        assert [[c.strip() for c in line.split("|")][at] for line in lines[2:]] == ["7.5 (3 ep)", "not in 4 ep"]
    resumed = {**rows[0], "epochs": 6, "first_epoch": 3, "seconds_to_target": 7.1, "epochs_to_target": 6}
    header, _, line = format_table([resumed]).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["epochs"] == "6 (from 3)" and cells["s to 0.85 acc"] == "7.1 (6 ep, timed from epoch 3)"


def test_a_target_outside_0_1_is_one_line():
    proc = compare("--target-accuracy", "85")
    assert proc.returncode == 2 and "--target-accuracy must be in (0, 1]" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_run_reports_every_epoch_s_accuracy_and_its_time_to_the_target(tmp_path):
    out = tmp_path / "r.json"
    proc = compare("--frameworks", "pytorch", "--devices", "1", "--epochs", "5", "--target-accuracy", "0.5",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    accuracies = run["epoch_test_accuracies"]
    assert len(accuracies) == 5 and accuracies[-1] == run["test_accuracy"]
    reached = next(i for i, a in enumerate(accuracies) if a >= 0.5)   # digits: past 0.5 within 5 epochs (6 steps each)
    assert run["epochs_to_target"] == reached + 1
    assert run["seconds_to_target"] == pytest.approx(sum(run["epoch_seconds"][:reached + 1]))
    assert "s to 0.5 acc" in proc.stdout
