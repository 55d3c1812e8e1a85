"""Where a step of several devices goes (harness/studies/split.py): the parts add up to the step, the compute is the scaling
efficiency's share, and in every framework the all-reduce alone is the row's own pattern of collectives and sums."""
import re

import numpy as np
import pytest

from common import FRAMEWORKS
from conftest import framework_or_skip
from harness.loader import load_module
from harness.spec import RunSpec
import os

from harness.processes.launch import run_workers
from harness.publishing.tables import format_split
from harness.studies.split import add_split, alongside, lockstep, measure


def row(**changes):
    return {"status": "ok", "framework": "pytorch", "mode": "scratch", "exec": "eager", "devices": 2, "processes": 2,
            "cores": "per-device", "threads": 1,
            "batch_size": 256, "images_per_second": 2000.0, "scaling_efficiency": 0.8, "epoch_seconds_median": 10.0,
            "input_seconds_median": 0.5, "allreduce_alone_seconds": 0.01, "allreduce_alone_pattern": "bucketed",
            **changes}


def test_the_parts_add_up_to_the_step_and_the_compute_is_the_scaling_share():
    r, unmeasured, unscaled = row(), row(allreduce_alone_seconds=None), row(scaling_efficiency=None)
    add_split([r, unmeasured, unscaled])
    s = r["step_split"]
    assert s["step"] == pytest.approx(256 / 2000)                    # 128 ms a global batch
    assert s["compute"] == pytest.approx(0.8 * 0.128)                # its 1-device rate's time for these images
    assert s["allreduce"] == 0.01 and s["input"] == pytest.approx(0.05 * 0.128)   # 5% of the epoch, per step
    assert s["rest"] == pytest.approx(0.128 - 0.1024 - 0.01 - 0.0064)
    assert "step_split" not in unmeasured and "step_split" not in unscaled
    table = format_split([r, unmeasured])
    assert table.count("\n") == 2   # the heading, its rule, one row
    assert "| 128.0 | 102.4 (80%) | 10.0 (8%) | 6.4 (5%) | 9.2 (7%) | 0.80 |" in table
    assert "| pytorch | 1 per device | scratch (eager), bucketed all-reduce, 2 devices, 2 processes |" in table
    assert format_split([unmeasured]) == ""


def test_lockstep_waits_for_each_step_s_slower_process_and_leaves_out_the_first():
    mean, slowest = lockstep([[9.0, 1.0, 3.0, 2.0], [7.0, 2.0, 1.0, 2.0, 5.0]])   # the common steps only
    assert mean == pytest.approx((1 + 3 + 2 + 2 + 1 + 2) / 6)
    assert slowest == pytest.approx((2 + 3 + 2) / 3)
    assert lockstep([[4.0], [2.0, 9.0]]) == (3.0, 4.0)   # a one-step run keeps its only step


def test_the_processes_alongside_split_the_rest_into_sharing_and_waiting():
    r, plain = row(alongside_seconds=0.105, lockstep_seconds=0.108), row()
    add_split([r, plain])
    s = r["step_split"]
    assert s["sharing"] == pytest.approx(0.105 - 0.1024)             # alongside, less the compute alone
    assert s["lockstep"] == pytest.approx(0.003)                     # each step's slower process, less the mean
    assert s["rest"] == pytest.approx(0.128 - 0.108 - 0.01 - 0.0064)   # what neither explains
    assert s["step"] == pytest.approx(sum(v for k, v in s.items() if k != "step"))
    table = format_split([r, plain])
    assert "| waiting for the slower step | rest | scaling | against them alongside |" in table
    assert "| 128.0 | 102.4 (80%) | 10.0 (8%) | 6.4 (5%) | 2.6 (2%) | 3.0 (2%) | 3.6 (3%) | 0.80 | 0.84 |" in table
    assert "| 6.4 (5%) |  |  | 9.2 (7%) | 0.80 | |" in table   # a row without them keeps its whole rest


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores")
def test_the_processes_alongside_are_independent_runs_pinned_as_the_row_s_workers(monkeypatch):
    """Two DistributedDataParallel runs of one process each at once (each its own process group, so its own port),
    a core each as the 2-process row's workers, half the row's batch each: every step of each timed."""
    framework_or_skip("pytorch")
    usable = sorted(os.sched_getaffinity(0))
    spec = RunSpec("pytorch", task="devices", devices=1, processes=1, threads=1, cores="per-device")
    assert [r["cpus"] for r in run_workers(spec, timeout=120, copies=2)] == [usable[:1], usable[1:2]]
    row_spec = RunSpec("pytorch", mode="builtin", devices=2, processes=2, threads=1, cores="per-device",
                       dataset="synthetic", n_synthetic=1024, batch_size=128, epochs=1)
    records = run_workers(row_spec.replace(processes=1, devices=1, batch_size=64), timeout=300, copies=2)
    assert [r["status"] for r in records] == ["ok", "ok"] and [r["cpus"] for r in records] == [usable[:1], usable[1:2]]
    assert [len(r["step_seconds"]) for r in records] == [16, 16] and all(r["world"] == 1 for r in records)
    from harness.processes import launch
    from harness.processes.cluster import ONE_HOST
    seen = []
    monkeypatch.setattr(launch, "run_workers", lambda *a, **k: seen.extend(run_workers(*a, **k)) or seen)
    measured = alongside(row_spec, 300, ONE_HOST, 1024)
    assert [len(r["step_seconds"]) for r in seen] == [8, 8]   # the row's steps, not the copies' whole epoch
    assert 0 < measured["alongside_seconds"] <= measured["lockstep_seconds"] < 5


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_allreduce_alone_is_the_row_s_pattern_and_sums(name, monkeypatch):
    """In one process over 2 devices (the worker's task, called directly): the scratch row's --allreduce, the built-in
    engine's declared pattern; an all-reduce that does not sum is refused, not timed."""
    fw = framework_or_skip(name)
    devices = fw.get_devices(2)
    for mode, allreduce in (("scratch", "per-tensor"), ("scratch", "bucketed"), ("builtin", "per-tensor")):
        spec = RunSpec(name, mode=mode, allreduce=allreduce, devices=2, dataset="synthetic")
        result = measure(fw, spec, 0, 1, devices)
        expected = allreduce if mode == "scratch" else load_module(name, "builtin").ALLREDUCE
        assert result["allreduce"] == expected and result["repeats"] == 20 and 0 < result["min"] <= result["median"]
    data_parallel = load_module(name, "data_parallel")
    monkeypatch.setattr(data_parallel, "allreduce_gradients", lambda grads, bucket_bytes=None: grads)   # sums nothing
    with pytest.raises(RuntimeError, match="summed to 1.0, not 2"):
        measure(fw, RunSpec(name, devices=2, dataset="synthetic"), 0, 1, devices)


def test_jax_s_compiled_builtin_step_all_reduces_each_parameter_alone():
    """What jax/builtin.py's ALLREDUCE says: XLA's CPU compiler keeps one all-reduce per gradient (not combined)."""
    framework_or_skip("jax")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from common.lenet import PARAM_SHAPES, init_weights
    builtin = load_module("jax", "builtin")
    net, step, mesh = builtin.get_model(init_weights(0), jax.devices()[:2])[:3]
    rows = NamedSharding(mesh, P("devices"))
    X, y, mask = (jax.device_put(a, rows) for a in (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int32),
                                                     np.ones(8, np.float32)))
    hlo = step.lower(net, X, y, mask, jnp.float32(0.1)).compile().as_text()
    reductions = re.findall(r"= f32\[[\d,]*\]\{[\d,]*\} all-reduce\(", hlo)
    assert builtin.ALLREDUCE == "per-tensor" and len(reductions) == len(PARAM_SHAPES) == 8


def test_a_trial_stopped_while_its_step_is_split_is_kept_with_what_was_measured(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while a finished trial's processes run again (its all-reduce alone, its processes
    alongside) loses neither the trial nor the part already measured."""
    import json

    import compare
    monkeypatch.setattr(compare, "raise_on_signals", lambda: None)
    monkeypatch.setattr("harness.run.trials.matmul_peak", lambda threads: 100.0)
    monkeypatch.setattr("harness.run.trials.low_matmul_peaks", lambda threads, names: {"fp32": 100.0})
    monkeypatch.setattr("harness.run.trials.machine_lockstep", lambda cores: {   # test_calibration's subject
        "cores": list(cores), "step_seconds": 0.1, "lockstep_seconds": 0.11})
    monkeypatch.setattr("harness.run.trials.run_trial", lambda spec, dataset, args, label, trial: {
        "status": "ok", "error": None, "images_per_second": 2000.0, "train_seconds": 1.0})
    monkeypatch.setattr("harness.run.trials.allreduce_alone", lambda spec, timeout, cluster: {
        "allreduce_alone_seconds": 0.01, "allreduce_alone_pattern": "per-tensor"})

    def stopped(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr("harness.run.trials.alongside", stopped)
    out = tmp_path / "run.json"
    assert compare.main(["--frameworks", "pytorch", "--mode", "scratch", "--devices", "2", "--processes", "2",
                         "--dataset", "synthetic", "--n-synthetic", "600", "--epochs", "1", "--repeats", "2",
                         "--json", str(out)]) == 130   # the shell's code for Ctrl-C
    (row,) = json.loads(out.read_text())["runs"]
    assert row["trials"] == 1 and row["images_per_second"] == 2000.0 and row["allreduce_alone_seconds"] == 0.01
