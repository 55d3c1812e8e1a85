"""Cores per device (harness/processes/cores.py): each worker of a per-device run pinned to cores of its own, thread
counts that give each device its share, and the benchmark rows and files that report it."""
import csv
import json
import os

import pytest

from harness.processes import cores
from harness.studies.benchmark import add_scaling
from harness.processes.launch import run_workers
from conftest import framework_or_skip

USABLE = sorted(os.sched_getaffinity(0))


def test_shared_cores_give_every_op_all_threads():
    env = cores.thread_env(2, "shared", local_devices=2)
    assert env["OMP_NUM_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == env["MXNET_CPU_WORKER_NTHREADS"] == "2"


def test_a_core_per_device_gives_each_op_one_device_s_share_and_the_schedulers_a_thread_per_device():
    env = cores.thread_env(4, "per-device", local_devices=2)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == "2"
    assert env["TF_NUM_INTEROP_THREADS"] == "2"   # the two devices' ops side by side
    assert env["MXNET_CPU_WORKER_NTHREADS"] == "1"   # MXNet's engine has a pool per context: one thread each
    # MXNet's scratch buffers, one pool for every CPU context: 16 per context, in either setting (harness/processes/cores.py;
    # what they buy depends on the machine: docs/profiling.md)
    assert env["MXNET_CPU_TEMP_COPY"] == cores.thread_env(2, "shared", local_devices=2)["MXNET_CPU_TEMP_COPY"] == "32"
    assert cores.thread_env(2, "shared", local_devices=1)["MXNET_CPU_TEMP_COPY"] == "16"
    # Gluon's SyncBatchNorm hangs unless no two contexts' ops share a copy: 128 per context (common/cpu_scratch.py)
    assert cores.thread_env(2, "shared", local_devices=4, sync_batchnorm=True)["MXNET_CPU_TEMP_COPY"] == "512"


def test_each_worker_gets_cores_of_its_own():
    assert cores.worker_cpus(0, 2, available=[3, 5, 7, 9]) == [3, 5]
    assert cores.worker_cpus(1, 2, available=[3, 5, 7, 9]) == [7, 9]
    with pytest.raises(ValueError, match="needs cores 2-3"):
        cores.worker_cpus(1, 2, available=[0, 1, 2])
    assert cores.per_device_threads(8, 2) == 4 and cores.per_device_threads(2, 2) == 1


@pytest.mark.slow
@pytest.mark.skipif(len(USABLE) < 2, reason="needs 2 usable cores")
def test_per_device_workers_are_really_pinned_and_shared_ones_are_not():
    framework_or_skip("pytorch")
    spec = {"task": "devices", "framework": "pytorch", "devices": 2, "processes": 2, "threads": 1, "cores": "per-device"}
    results = run_workers(spec, timeout=120)
    assert [r["cpus"] for r in results] == [USABLE[:1], USABLE[1:2]]
    (alone,) = run_workers({**spec, "devices": 1, "processes": 1, "cores": "shared"}, timeout=120)
    assert alone["cpus"] == USABLE


def row(framework, mode, exec_, devices, processes, cores_, ips):
    return {"framework": framework, "mode": mode, "exec": exec_, "devices": devices, "processes": processes,
            "cores": cores_, "status": "ok", "images_per_second": ips}


def test_scaling_compares_like_with_like_and_says_what_with():
    rows = [row("mxnet", "scratch", "hybridize", 1, 1, "shared", 3000),
            row("mxnet", "scratch", "imperative", 1, 1, "shared", 2000),
            row("mxnet", "scratch", "hybridize", 2, 1, "shared", 3000),
            row("mxnet", "builtin", "hybridize", 2, 1, "shared", 3300),    # two scratch rows: no base
            row("mxnet", "scratch", "hybridize", 1, 1, "per-device", 2000),
            row("mxnet", "scratch", "hybridize", 2, 2, "per-device", 3600),
            row("mxnet", "builtin", "hybridize", 2, 2, "per-device", 3200)]
    add_scaling(rows)
    assert [r["scaling_efficiency"] for r in rows] == [1.0, 1.0, 0.5, None, 1.0, 0.9, 0.8]
    assert rows[5]["scaling_base"] == rows[6]["scaling_base"] == "scratch (hybridize), 1 device"


def test_each_round_s_scaling_pairs_a_trial_with_its_base_s_trial_of_the_same_round():
    """The machine drifts over a run (a 1-device row's own trials 1,456-2,296 images/s): trial k of a row is paired
    with trial k of its base, run in the same pass over the rows; the ratio of the medians stays the headline."""
    from harness.publishing.tables import format_scaling
    from harness.publishing.tables import format_split
    base = {**row("pytorch", "builtin", "eager", 1, 1, "per-device", 1000), "trial_images_per_second": [1000, 800, 1200]}
    two = {**row("pytorch", "builtin", "eager", 2, 2, "per-device", 1600), "trial_images_per_second": [1800, 1200, 1600]}
    short = {**row("pytorch", "builtin", "eager", 2, 2, "shared", 1600), "trial_images_per_second": [1800, 1200]}
    lone = row("pytorch", "builtin", "eager", 1, 1, "shared", 1000)
    add_scaling([base, two, short, lone])
    assert two["scaling_efficiency"] == pytest.approx(0.8)
    assert two["scaling_rounds"] == pytest.approx([0.9, 0.75, 2 / 3])
    assert (two["scaling_efficiency_min"], two["scaling_efficiency_max"]) == pytest.approx((2 / 3, 0.9))
    assert short["scaling_rounds"] is None and short["scaling_efficiency_min"] is None   # no trials to pair with
    assert "| efficiency (lowest-highest round) |" in format_scaling([base, two])
    assert "| 0.80 (0.67-0.90) |" in format_scaling([base, two])
    assert "| efficiency |" in format_scaling([lone, short]) and "| 0.80 |" in format_scaling([lone, short])
    two.update(batch_size=256, allreduce_alone_seconds=0.01, allreduce_alone_pattern="bucketed",
               epoch_seconds_median=10.0, input_seconds_median=0.1)
    from harness.studies.split import add_split
    add_split([two])
    assert "| scaling (lowest-highest round) |" in format_split([two]) and "| 0.80 (0.67-0.90) |" in format_split([two])


def test_every_benchmark_engine_of_several_devices_is_compared_with_itself_on_one():
    """A built-in engine may run its framework's own layers (the ResNet's DDP and Gluon Trainer: 1.4x and 2.3x the
    scratch step on one device), so against the scratch 1-device row its scaling passed 1 and its split's compute
    passed the whole step. The benchmark plan gives every mode of several devices its own 1-device row, per cores."""
    from harness.run.plan import BENCHMARK, benchmark_plan
    for model in ("lenet", "resnet18"):
        entries = benchmark_plan(BENCHMARK["plan"], model)
        ones = {(mode, cores_) for mode, _, shapes, cores_, *_ in entries if (1, 1) in shapes}
        for mode, _, shapes, cores_, *_ in entries:
            if any(devices > 1 for devices, _ in shapes):
                assert (mode, cores_) in ones, (model, mode, cores_)
    rows = [row("pytorch", "scratch", "eager", 1, 1, "per-device", 600),
            row("pytorch", "builtin", "eager", 1, 1, "per-device", 900),
            row("pytorch", "builtin", "eager", 2, 2, "per-device", 1620)]
    add_scaling(rows)
    assert rows[2]["scaling_efficiency"] == pytest.approx(0.9)
    assert rows[2]["scaling_base"] == "builtin (eager), 1 device"


def test_the_peak_memory_of_training_leaves_out_what_came_before():
    """VmHWM restarted: a large array freed before the reset no longer counts (the synthetic set's
    generation peaks at ~1.3 GiB at 60,000 images; training does not)."""
    import numpy as np

    from harness.run.worker import peak_rss, reset_peak_rss
    big = np.ones(300 * 2**20 // 8)
    before = peak_rss()
    del big
    assert reset_peak_rss()
    small = np.ones(20 * 2**20 // 8)
    after = peak_rss()
    assert small.sum() > 0 and after < before - 200 * 2**20


@pytest.mark.slow
@pytest.mark.skipif(len(USABLE) < 2, reason="a core per device for 2 devices needs 2 usable cores")
def test_the_benchmark_reports_both_core_settings_in_every_file(benchmark_run):
    """A real --benchmark shrunk to PyTorch on a few steps (conftest.benchmark_run): shared and per-device rows, the
    per-device rows' thread counts, the scaling section in the markdown, and a CSV with every printed column."""
    content = json.loads((benchmark_run / "benchmark.json").read_text())
    runs = content["runs"]
    steady = content["environment"]["calibration"]["lockstep"]   # the machine's own waiting, for the 2-process rows
    assert steady["cores"] == USABLE[:2] and steady["lockstep_seconds"] > steady["step_seconds"] > 0
    shape = [(r["cores"], r["devices"], r["processes"], r["threads"], r["status"]) for r in runs]
    assert shape == [("shared", 1, 1, 2, "ok"), ("per-device", 1, 1, 1, "ok"), ("per-device", 2, 1, 2, "ok"),
                     ("per-device", 2, 2, 1, "ok"), ("per-device", 2, 2, 1, "ok"), ("per-device", 2, 2, 1, "skipped")]
    assert "the same run as pytorch builtin (default), 2 device(s), 2 process(es)" in runs[-1]["error"]
    assert runs[4]["compiles"] == "nothing" and runs[0]["compiles"] == "nothing"
    assert all(0 < r["train_memory_bytes"] < r["peak_rss_bytes"] for r in runs[:5])
    markdown = (benchmark_run / "benchmark.md").read_text()
    assert "| 1 per device |" in markdown and "shared, 2 " in markdown and "efficiency |" in markdown
    assert "waiting for the slower step +" in markdown
    with open(benchmark_run / "benchmark.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(runs)
    for column in ("epochs", "train_seconds", "final_loss", "step1_loss_diff", "cores", "compiles", "layout",
                   "train_memory_mib", "peak_fraction", "scaling_efficiency"):
        assert table[0][column] != "", column
    assert "peak_device_memory_mib" not in table[0]   # no GPU: a column that could only be empty is left out
    assert float(table[2]["scaling_efficiency"]) == pytest.approx(runs[2]["scaling_efficiency"], abs=1e-3)
    # every row of several devices with its step split (harness/studies/split.py): the all-reduce alone measured in processes
    # placed as the row's, its pattern the row's (DDP's buckets for the built-in engine), the parts adding up
    for r in runs[2:5]:
        split = r["step_split"]
        assert split["compute"] == pytest.approx(split["step"] * r["scaling_efficiency"])
        assert split["allreduce"] == r["allreduce_alone_seconds"] > 0
        assert sum(v for k, v in split.items() if k != "step") == pytest.approx(split["step"])
        # a row of several processes has its processes run again alongside each other: its rest in parts
        assert ("lockstep" in split) == (r["processes"] > 1) == ((r.get("lockstep_seconds") or 0) >= (r.get(
            "alongside_seconds") or 1) > 0)
    assert [r["allreduce_alone_pattern"] for r in runs[2:5]] == ["per-tensor", "per-tensor", "bucketed"]
    assert "step_split" not in runs[0] and "step_split" not in runs[1]
    assert "Where each step of several devices goes" in markdown
    assert "| builtin (eager+DDP), bucketed all-reduce, 2 devices, 2 processes |" in markdown
    assert float(table[4]["allreduce_ms"]) == pytest.approx(1e3 * runs[4]["allreduce_alone_seconds"], abs=0.01)


def test_scaling_is_against_the_1_device_row_of_the_same_batch_per_device():
    """--per-device-batch 8,64 --devices 1,2: every row was against the batch-8 row (5.46 and 12.20 for the 2-device
    rows). A row of --per-device-batch is against the 1-device row of its batch per device; a row of --batch-size
    (every device count sharing one batch) against the 1-device row of its batch, as before; sharded against sharded."""
    rows = [{**row("pytorch", "scratch", "eager", d, 1, "shared", ips), "batch_size": b}
            for b, d, ips in ((8, 1, 500), (16, 2, 900), (64, 1, 2000), (128, 2, 3000))]
    plain = [{**row("pytorch", "scratch", "eager", d, 1, "shared", ips), "batch_size": 256, "shard": shard}
             for d, ips, shard in ((1, 1000, "none"), (2, 1600, "none"), (1, 800, "parameters"), (2, 1200, "parameters"))]
    add_scaling(rows + plain)
    assert [r["scaling_efficiency"] for r in rows] == pytest.approx([1.0, 0.9, 1.0, 0.75])
    assert rows[3]["scaling_base"] == "scratch (eager), 1 device, batch 64"
    assert [r["scaling_efficiency"] for r in plain] == pytest.approx([1.0, 0.8, 1.0, 0.75])
    assert plain[1]["scaling_base"] == "scratch (eager), 1 device"
