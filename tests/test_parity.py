"""The heart of the repo: from identical weights and batches, the four frameworks compute the same
training, step for step. Skipped frameworks (not installed) drop out; at least two must remain."""
import json
import os

import numpy as np
import pytest

from common.batches import epoch_batches
from common.lenet import init_weights
from conftest import FAST_COMPILE_FLAGS, installed_frameworks, replicas_of, run_compare, weights_of
from conftest import train_steps as one_step


@pytest.fixture(scope="module")
def frameworks():
    available = installed_frameworks()
    if len(available) < 2:
        pytest.skip("parity needs at least two installed frameworks")
    return available


def train_steps(fw, data, n_devices, steps, batch_size, seed, lr=0.2):
    devices = fw.get_devices(n_devices)
    replicas = replicas_of(fw, init_weights(seed), devices)
    losses = []
    for idx in epoch_batches(len(data.y_train), batch_size, seed, 0)[:steps]:
        losses.append(one_step(fw, replicas, data.X_train[idx], data.y_train[idx], devices, lr))
    return losses, [weights_of(fw, r) for r in replicas]


@pytest.mark.parametrize("n_devices,batch_size,seed", [(2, 256, 0), (3, 101, 7), (4, 64, 3)])
def test_one_step_gives_the_same_loss_and_weights_everywhere(frameworks, digits, n_devices, batch_size, seed):
    (ref_loss,), ref_replicas = train_steps(frameworks[0], digits, n_devices, 1, batch_size, seed)
    for fw in frameworks[1:]:
        (loss,), replicas = train_steps(fw, digits, n_devices, 1, batch_size, seed)
        assert abs(loss - ref_loss) <= 1e-5, fw.name
        for replica in replicas:   # every replica of every framework
            for name, value in ref_replicas[0].items():
                assert np.max(np.abs(replica[name] - value)) <= 1e-5, (fw.name, name)


def test_the_first_five_steps_agree(frameworks, digits):
    ref, _ = train_steps(frameworks[0], digits, 2, 5, 256, 0)
    assert ref[-1] < ref[0]
    for fw in frameworks[1:]:
        losses, _ = train_steps(fw, digits, 2, 5, 256, 0)
        np.testing.assert_allclose(losses, ref, atol=1e-4, err_msg=fw.name)


@pytest.mark.slow
@pytest.mark.timeout(600)   # every framework's default run, on a possibly busy machine
def test_a_full_default_run_agrees_on_accuracy(frameworks, tmp_path):
    """`python compare.py` as a new user runs it: every framework ok, >= 0.95 on digits, within 1.5 points."""
    out = tmp_path / "default.json"
    as_a_user = {**os.environ, "XLA_FLAGS": " ".join(f for f in os.environ["XLA_FLAGS"].split()
                                                     if f not in FAST_COMPILE_FLAGS)}
    proc = run_compare("--json", str(out), env=as_a_user)   # JAX compiled as it is outside the suite
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {r["framework"]: r for r in json.loads(out.read_text())["runs"]}
    accuracies = {fw.name: runs[fw.name]["test_accuracy"] for fw in frameworks}
    assert all(runs[fw.name]["status"] == "ok" for fw in frameworks)
    assert min(accuracies.values()) >= 0.95, accuracies
    assert max(accuracies.values()) - min(accuracies.values()) <= 0.015, accuracies
    for fw in frameworks:   # same start: the first-step losses shown in the table agree
        assert runs[fw.name]["step1_loss_diff"] <= 1e-5
