"""The benchmark's yardsticks: a plausible matmul peak, and a load record that counts other processes' CPU
time but not the run's own (robust to a busy machine: the busy work is measured in CPU seconds)."""
import os
import subprocess
import sys
import time

import pytest

from harness.studies import calibration

BUSY = "import time\nwhile time.process_time() < 1.0: pass\n"   # one CPU second, however long it takes


def test_the_matmul_peak_is_a_plausible_gflops_figure():
    peak = calibration.matmul_peak(threads=1, n=512, seconds=0.5)
    assert 1 < peak < 5000   # GFLOP/s of one core: more than a toy loop, less than a GPU


def test_the_run_s_own_work_does_not_count_as_load():
    record = calibration.LoadRecord().start()
    subprocess.run([sys.executable, "-c", BUSY], check=True, timeout=120)   # a worker of the run, waited for
    load = record.stop()
    assert load["own_cpu_seconds"] >= 1.0, load


def another_process_s_cpu_second(folder):
    """One CPU second of a grandchild, orphaned at once: never reaped by us, so its CPU time is someone else's."""
    done = folder / "done"
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{BUSY}open(\"{done}\", \"w\")' &"], check=True)
    deadline = time.monotonic() + 120
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_another_process_s_work_is_load_and_makes_a_warning(tmp_path):
    record = calibration.LoadRecord().start()
    another_process_s_cpu_second(tmp_path)
    time.sleep(0.2)
    load = record.stop()
    assert load["other_cpu_seconds"] >= 0.9, load
    if load["wall_seconds"] * (os.cpu_count() or 1) * calibration.QUIET_SHARE < load["other_cpu_seconds"]:
        assert not load["quiet"] and calibration.warning(load).startswith("warning: the machine was not quiet")


def test_a_plain_run_on_a_busy_machine_says_so(tmp_path, monkeypatch, capsys):
    """Every run prints its speeds, not only the benchmark: its file records the load too, and a busy machine
    gets the warning. One other process on one of two cores took PyTorch's LeNet from 5,360 to 244 images/s and
    MXNet's from 2,535 to 2,288 (docs/profiling.md): such a table misleads, and nothing said so."""
    import json

    import compare

    def busy_trial(spec, dataset, args, label, trial):   # another process's CPU second while the row "trains"
        another_process_s_cpu_second(tmp_path)
        return {"status": "ok", "error": None, "images_per_second": 2000.0, "train_seconds": 1.0}
    monkeypatch.setattr(compare, "raise_on_signals", lambda: None)
    monkeypatch.setattr("harness.run.trials.run_trial", busy_trial)
    out = tmp_path / "run.json"
    assert compare.main(["--frameworks", "pytorch", "--devices", "1", "--dataset", "synthetic", "--n-synthetic", "600",
                         "--epochs", "1", "--json", str(out)]) == 0
    load = json.loads(out.read_text())["environment"]["load"]
    assert load["other_cpu_seconds"] >= 0.9, load
    if load["wall_seconds"] * (os.cpu_count() or 1) * calibration.QUIET_SHARE < load["other_cpu_seconds"]:
        assert not load["quiet"] and capsys.readouterr().err.count("warning: the machine was not quiet") == 1


def test_numpy_steps_in_lockstep_pay_for_the_slower_core_each_step():
    """The machine's own waiting, no framework: a pinned numpy process per core, each step's slower one counted.
    A step of the requested length, the waiting never negative, and the line that reports it."""
    from harness.publishing.provenance import environment_line
    cores = (sorted(os.sched_getaffinity(0)) * 2)[:2]   # one core twice on a one-core machine: they take turns
    steady = calibration.machine_lockstep(cores, step_seconds=0.02, steps=20)
    assert steady["cores"] == cores and 0.002 < steady["step_seconds"] < 0.2, steady
    assert steady["lockstep_seconds"] > steady["step_seconds"], steady   # max over cores, not their mean
    from harness.publishing.provenance import provenance
    env = {**provenance(), "gpus": [], "python": "3.11", "frameworks": {}, "numpy": "1.26", "platform": "linux",
           "calibration": {"threads": 2, "matmul_peak_gflops_start": 100.0,
                           "lockstep": {"cores": [0, 1], "step_seconds": 0.08, "lockstep_seconds": 0.0872}}}
    assert "pinned to each of cores 0, 1, 80 ms steps: waiting for the slower step +9.0%" in environment_line(env)


def test_a_quiet_record_has_no_warning():
    assert calibration.warning({"quiet": True}) is None


@pytest.mark.slow
def test_the_benchmark_records_its_calibration_and_each_row_s_share_of_peak(benchmark_run):
    """A real --benchmark, shrunk (conftest.benchmark_run): the JSON holds numpy's matmul peak at the start and the
    end, PyTorch's fp32 peak and the load record; each row's fraction of peak is its GFLOP/s over the higher of
    numpy's mean and PyTorch's; the markdown says so."""
    import json
    content = json.loads((benchmark_run / "benchmark.json").read_text())
    calibration, load = content["environment"]["calibration"], content["environment"]["load"]
    start, end = calibration["matmul_peak_gflops_start"], calibration["matmul_peak_gflops_end"]
    assert start > 1 and end > 1 and {"quiet", "other_cpu_share", "loadavg_start"} <= set(load)
    # PyTorch is installed: its fp32 peak is measured beside numpy's, whose BLAS may not know the CPU (numpy 1.26's
    # OpenBLAS reached 35-41 GFLOP/s on an Intel Xeon with AMX where PyTorch reached 267: rows at "210% of peak")
    torch_peaks = calibration["low_matmul_peaks_gflops"]
    assert list(torch_peaks) == ["fp32"] and torch_peaks["fp32"] > 1   # an fp32 run: no bf16 or fp16 peak
    peak = max((start + end) / 2, torch_peaks["fp32"])
    markdown = (benchmark_run / "benchmark.md").read_text()
    assert "Float32 matmul peak" in markdown and f"PyTorch's matmul at the start: fp32 {torch_peaks['fp32']:.0f}" \
        in markdown
    trained = [row for row in content["runs"] if row["status"] == "ok"]
    assert trained and trained[0]["cores"] == "shared"   # and the per-device rows where there are cores for them
    for row in trained:
        assert row["peak_fraction"] == pytest.approx(row["gflops"] / peak)
        assert f"{100 * row['peak_fraction']:.0f}%" in markdown


@pytest.mark.slow
def test_repeated_trials_are_timed_against_the_peak_too(tmp_path, monkeypatch):
    """--repeats > 1 is the timing view outside the benchmark as well (the ResNet's scaling rows): the run measures
    the matmul peak around itself, and each row gets its fraction of it."""
    import json

    import compare
    from conftest import framework_or_skip
    framework_or_skip("pytorch")
    peaks = iter([100.0, 300.0])
    monkeypatch.setattr("harness.run.trials.matmul_peak", lambda threads: next(peaks))
    measured = []   # PyTorch's fp32 peak, asked for beside numpy's: above their mean here, so it is the yardstick
    monkeypatch.setattr("harness.run.trials.low_matmul_peaks", lambda threads, names: measured.append(names) or {
        "fp32": 250.0})
    monkeypatch.setattr(compare, "raise_on_signals", lambda: None)
    out = tmp_path / "run.json"
    assert compare.main(["--frameworks", "pytorch", "--devices", "1", "--dataset", "synthetic", "--n-synthetic",
                         "600", "--epochs", "1", "--repeats", "2", "--json", str(out)]) == 0
    content = json.loads(out.read_text())
    assert content["environment"]["calibration"]["matmul_peak_gflops_end"] == 300.0
    assert "lockstep" not in content["environment"]["calibration"]   # measured for runs of several processes
    (row,) = content["runs"]
    assert row["trials"] == 2 and row["peak_fraction"] == pytest.approx(row["gflops"] / 250.0)   # not numpy's 200
    assert measured == [("fp32",)] and content["environment"]["calibration"]["low_matmul_peaks_gflops"] == {
        "fp32": 250.0}


def test_a_timed_fp32_run_keeps_numpy_s_yardstick_where_pytorch_s_peak_cannot_be_measured(monkeypatch, capsys):
    """PyTorch's fp32 peak is a second yardstick for fp32 rows: where it cannot be measured (a broken PyTorch), the
    run goes on with numpy's and says so in one line. A low-precision run needs PyTorch's peaks: it fails, in one
    line."""
    import subprocess
    from argparse import Namespace

    from harness.run import trials

    def broken(threads, names):
        raise subprocess.CalledProcessError(1, ["python", "-c", "import torch"])
    monkeypatch.setattr(trials, "matmul_peak", lambda threads: 100.0)
    monkeypatch.setattr(trials, "low_matmul_peaks", broken)
    monkeypatch.setattr(trials, "installed_version", lambda name: "2.13.0")
    env = {}
    args = Namespace(threads=1, precision=["fp32"], cluster=Namespace(nnodes=1))
    trials.calibrate(args, env, [])
    assert env["calibration"] == {"threads": 1, "matmul_peak_gflops_start": 100.0}
    assert "note: PyTorch's fp32 matmul peak could not be measured (CalledProcessError)" in capsys.readouterr().err
    from common import RosettaError   # compare.py prints it as one line
    with pytest.raises(RosettaError, match=r"PyTorch's bf16 matmul peak, .* could not be measured "
                                           r"\(CalledProcessError: check that `import torch` works\)"):
        trials.calibrate(Namespace(threads=1, precision=["fp32", "bf16"], cluster=Namespace(nnodes=1)), {}, [])


def test_a_low_precision_run_measures_the_peaks_of_its_own_precisions_only(monkeypatch):
    """fp16's matmul has no fast kernel on a CPU without AVX512-FP16 (a minute at 2048 on the AMD EPYC): a bf16 run
    measured it too, twice, and the whole run was refused when that passed the timeout."""
    from argparse import Namespace

    from harness.run import trials
    measured = []
    monkeypatch.setattr(trials, "matmul_peak", lambda threads: 100.0)
    monkeypatch.setattr(trials, "low_matmul_peaks", lambda threads, names: measured.append(names) or dict.fromkeys(
        names, 1.0))
    for precisions in (["fp32", "bf16"], ["bf16"], ["fp16", "fp32", "bf16"]):
        trials.calibrate(Namespace(threads=1, precision=precisions, cluster=Namespace(nnodes=1)), {}, [])
    assert measured == [("fp32", "bf16"), ("fp32", "bf16"), ("fp32", "bf16", "fp16")]
