"""compare.py end to end, as a user runs it: a real small run, the JSON it writes, and bad input."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, STUB_TRAINING, run_compare as compare


@pytest.mark.slow
def test_small_pytorch_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "r.json"
    proc = compare("--frameworks", "pytorch", "--devices", "1,2", "--epochs", "2", "--batch-size", "128",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    env = report["environment"]
    assert {"python", "platform", "cpu", "frameworks", "gpus", "commit", "tree_modified", "date", "load_average"} <= set(env)
    assert env["frameworks"]["pytorch"].startswith("2.13")
    assert report["dataset"]["name"] == "digits" and report["dataset"]["n_train"] == 1437
    assert len(report["dataset"]["fingerprint"]) == 16
    one, two = report["runs"]
    for run in (one, two):
        assert run["status"] == "ok" and run["error"] is None
        assert run["framework"] == "pytorch" and run["mode"] == "scratch" and run["processes"] == 1
        assert run["epochs"] == 2 and len(run["epoch_losses"]) == 2 and run["batch_size"] == 128
        assert run["epoch_losses"][1] < run["epoch_losses"][0]
        assert 0.1 < run["test_accuracy"] <= 1.0
        assert run["train_seconds"] > 0 and run["images_per_second"] > 0
        assert run["fingerprint"] == report["dataset"]["fingerprint"]
        assert run["replica_spread"] == 0.0
    assert (one["devices"], two["devices"]) == (1, 2)
    # same batches and weights on 1 and 2 devices: the same training, to float32 round-off
    assert two["step_losses"][:5] == pytest.approx(one["step_losses"][:5], abs=1e-4)
    table = proc.stdout
    assert "| framework" in table and table.count("| pytorch") == 2
    assert "[#" not in proc.stdout + proc.stderr   # no progress bar in pipes and logs


@pytest.mark.slow
def test_progress_bar_when_stdout_is_a_terminal():
    """The bar follows the worker's progress lines, whatever trains: the stub worker's (tests/stub_training.py)."""
    import pty
    import re
    from harness.run.worker import STUB_VARIABLE
    main, replica = pty.openpty()
    proc = subprocess.Popen([sys.executable, "compare.py", "--frameworks", "pytorch", "--devices", "1",
                             "--epochs", "10"], cwd=ROOT, stdout=replica, stderr=subprocess.DEVNULL,
                            env={**os.environ, STUB_VARIABLE: STUB_TRAINING})
    os.close(replica)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:   # the terminal closed: the run is over
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=60) == 0
    shown = b"".join(chunks).decode()
    bars = re.findall(r"\r  pytorch scratch \(default\), 1 device\(s\), 1 process\(es\) \[(#*)(\.*)\] (\d+)/60", shown)
    assert bars and all(len(done) + len(left) == 30 for done, left, _ in bars)
    assert [int(step) for *_, step in bars] == sorted(int(step) for *_, step in bars)   # it only moves forward
    assert "\r\x1b[K" in shown and "| pytorch" in shown.split("\x1b[K")[-1]   # cleared, then the table


@pytest.mark.slow
def test_missing_frameworks_show_as_skipped_not_fabricated(tmp_path):
    """Hide mxnet from the worker with a stub distribution path: it must show as skipped, with reason."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    (tmp_path / "sitecustomize.py").write_text(   # every distribution named mxnet* vanishes from metadata
        "import importlib.metadata as m\n"
        "_v, _d = m.version, m.distributions\n"
        "def version(name):\n"
        "    if name.startswith('mxnet'): raise m.PackageNotFoundError(name)\n"
        "    return _v(name)\n"
        "def distributions(**kw):\n"
        "    return [d for d in _d(**kw) if not d.metadata['Name'].lower().startswith('mxnet')]\n"
        "m.version, m.distributions = version, distributions\n")
    proc = compare("--frameworks", "mxnet", "--epochs", "1", env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: mxnet is not installed" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--frameworks", "caffe"], "unknown framework 'caffe'"),
    (["--devices", "0"], "must be an integer >= 1"),
    (["--devices", "two"], "comma-separated integers"),
    (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent/dir"], "does not exist"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--stall-timeout", "0"], "--stall-timeout must be > 0"),
    (["--resume"], "--resume continues a training run: it needs the --json PATH"),
    (["--dataset", "synthetic", "--n-synthetic", "5"], "has 5 images, fewer than one batch of 256"),
    (["--batch-size", "2000"], "the digits training set has 1437 images, fewer than one batch of 2000"),
    (["--resume-from", "ck/pytorch-scratch-2d-1p-epoch1.optimizer.pt"],   # the states of PyTorch and JAX end as
     "pytorch's optimizer state, read beside its checkpoint: give the checkpoint, pytorch-scratch-2d-1p-epoch1.pt"),
    (["--resume-from", "ck/jax-scratch-2d-1p-epoch1.optimizer.orbax"],    # their checkpoints do
     "jax's optimizer state, read beside its checkpoint: give the checkpoint, jax-scratch-2d-1p-epoch1.orbax"),
    (["--resume-from", "ck/mxnet-scratch-2d-1p-epoch1.loss-scale.json"], "the loss scaler's state, read beside"),
])
def test_bad_input_is_one_clear_line(args, message):
    proc = compare(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_corrupt_data_file_is_named_without_traceback(tmp_path):
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (tmp_path / name).write_bytes(b"\x00\x00\x08\x03garbage")
    proc = compare("--dataset", "mnist", "--data-dir", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "idx3-ubyte" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_list_devices():
    proc = compare("--list-devices", "--frameworks", "pytorch", "--devices", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("pytorch: [") == 3


def test_parity_column_compares_across_frameworks_modes_and_exec_levels():
    from harness.publishing.tables import add_parity
    runs = [{"framework": f, "mode": m, "exec": e, "devices": d, "processes": p, "status": "ok", "step_losses": [l]}
            for f, m, e, d, p, l in [("pytorch", "scratch", "eager", 2, 1, 2.5), ("mxnet", "scratch", "hybridize", 2, 1, 2.5001),
                                     ("tensorflow", "builtin", "tf.function", 2, 2, 2.4)]]
    runs.append({"framework": "mxnet", "mode": "scratch", "status": "failed"})
    add_parity(runs)
    assert [r.get("step1_loss_diff") for r in runs] == [0.0, pytest.approx(1e-4), pytest.approx(0.1), None]


def test_a_failed_row_s_error_is_one_line_of_the_table():
    """TensorFlow's graph errors hold the Python stack of the failing op's definition: in the status cell it broke
    the markdown table across 30 lines. The cell keeps the first line and the cause."""
    from harness.publishing.tables import format_table
    error = ("InvalidArgumentError: Graph execution error:\n\nDetected at node gradient_tape/Conv2DBackpropInput "
             "defined at (most recent call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n\n"
             "  File \"tensorflow/resnet.py\", line 197, in loss_and_grads\n\nConv2DCustomBackpropInputOp only "
             "supports NHWC.\n\t [[{{node gradient_tape/Conv2DBackpropInput}}]] [Op:__inference_step_on_shards_6211]")
    runs = [{"framework": "tensorflow", "mode": "scratch", "devices": 1, "processes": 1, "epochs": 1,
             "status": "failed", "error": error}]
    header, _, row = format_table(runs).splitlines()
    assert row.split("|")[-2].strip() == ("failed: InvalidArgumentError: Graph execution error: "
                                          "Conv2DCustomBackpropInputOp only supports NHWC.")


@pytest.mark.parametrize("option,path,message", [
    ("--json", "{file}/out.json", "is a file, not a directory"),
    ("--csv", "/proc/out.csv", "cannot create a file in /proc"),
    ("--json", "{tmp}", "it is a directory"),
    ("--plot", "{tmp}/curves.xyz", "matplotlib cannot write .xyz files"),
    ("--benchmark", None, "results is a file, not a directory"),
])
def test_unwritable_outputs_fail_before_any_training(option, path, message, tmp_path):
    (tmp_path / "file").write_text("a regular file")
    (tmp_path / "results").write_text("a regular file where --benchmark writes its folder")
    args = [option] + ([path.format(file=tmp_path / "file", tmp=tmp_path)] if path else [])
    start = time.monotonic()
    proc = compare("--frameworks", "pytorch", "--csv", str(tmp_path / "ok.csv"), *args, cwd=tmp_path)
    assert time.monotonic() - start < 10
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot write") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr   # no data loaded, no row started
    assert not (tmp_path / "ok.csv").exists()


@pytest.mark.parametrize("option,path,message", [
    ("--checkpoint-dir", "{file}", "it is a file, not a directory"),
    ("--profile", "/proc/traces", "cannot create a file in /proc/traces"),
])
def test_a_directory_the_rows_write_into_is_checked_before_any_row(option, path, message, tmp_path, capsys):
    """In process, as compare.main runs it: a row that cannot write its checkpoints or traces would fail each row
    with an OSError after its data loaded."""
    import compare
    (tmp_path / "file").write_text("a regular file")
    code = compare.main(["--frameworks", "pytorch", option, path.format(file=tmp_path / "file")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: cannot write into {option}") and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow   # two worker processes, under a second each: neither imports a framework
def test_a_hand_launched_worker_checks_its_record_s_path_first_and_says_why_it_failed(tmp_path):
    """usage.md's hand launch: an OUT it cannot write ends it before training (it trained to the end, then lost its
    record in a traceback); a spec it refuses is one line on stderr as well as in OUT (it said nothing)."""
    from harness.processes.launch import LOGS_VARIABLE
    from harness.run.worker import STUB_VARIABLE

    def worker(spec, out, stub=True):   # the real one refuses the framework before importing any
        return subprocess.run([sys.executable, "-m", "harness.run.worker", json.dumps(spec), out], cwd=ROOT, text=True,
                              capture_output=True, timeout=60,
                              env={**os.environ, LOGS_VARIABLE: str(tmp_path),   # the stub's files, if it ran
                                   **({STUB_VARIABLE: STUB_TRAINING} if stub else {})})
    (tmp_path / "file").write_text("a regular file")
    proc = worker({"framework": "pytorch", "epochs": 1}, str(tmp_path / "file" / "out-{rank}.json"))
    assert proc.returncode == 2 and "progress" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [f"error: cannot write {tmp_path}/file/out-{{rank}}.json: "
                                                f"{tmp_path}/file is a file, not a directory"]
    out = tmp_path / "out.json"
    proc = worker({"framework": "torch", "epochs": 1}, str(out), stub=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "failed: unknown framework 'torch'; choose from pytorch, mxnet, tensorflow, jax"]
    assert json.load(open(out))["error"] == proc.stderr.strip().removeprefix("failed: ")


def test_merge_says_when_a_file_is_not_a_worker_record(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"environment": {}, "dataset": {}, "runs": []}))
    proc = compare("--merge", str(report))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {report}: not a worker's record (compare.py's --json output, no status); --merge takes the "
        "out-{rank}.json files that python -m harness.run.worker writes"]


def test_help_shows_every_default():
    proc = compare("--help")
    assert proc.returncode == 0
    flat = " ".join(proc.stdout.split())
    for shown in ("--frameworks FRAMEWORKS comma-separated (default: pytorch,", "(default: scratch)",
                  "(default: digits)", "(default: 256)", "default by --optimizer: sgd 0.2, momentum 0.02",
                  "(default: sgd)", "(default: constant)", "(default: 1800)", "(default: 300)",
                  f"(default: {os.cpu_count()})", "default 30 for digits, 10 otherwise"):
        assert shown in flat, shown
    assert "(default: None)" not in flat and "(default: False)" not in flat
    for option in proc.stdout.split("\n  -")[1:]:   # one default each: a help that says its own in words keeps it
        assert " ".join(option.split()).count("(default:") <= 1, option


def test_files_are_replaced_whole_or_not_at_all(tmp_path):
    from harness.files import replaced_atomically
    path = tmp_path / "out.json"
    path.write_text("the previous run")
    with pytest.raises(KeyboardInterrupt):
        with replaced_atomically(str(path)) as f:
            f.write("half of the ne")
            raise KeyboardInterrupt   # a signal in the middle of writing
    assert path.read_text() == "the previous run" and os.listdir(tmp_path) == ["out.json"]
    with replaced_atomically(str(path)) as f:
        f.write("the new run")
    assert path.read_text() == "the new run" and os.listdir(tmp_path) == ["out.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask   # as open() makes it, not private to its owner


def test_resume_restores_every_trial_of_a_kept_row():
    """A row of several trials keeps each trial's metrics: --resume rebuilds the same row from the file."""
    from harness.studies.benchmark import aggregate
    from harness.run.resume import kept_trials
    trials = [{"row": "r", "framework": "pytorch", "status": "ok", "error": None, "images_per_second": ips,
               "train_seconds": 10 / ips, "step_losses": [2.3, 2.1]} for ips in (100.0, 300.0, 200.0)]
    row = aggregate(trials)
    restored = kept_trials({"runs": [json.loads(json.dumps(row))]}, "r")
    assert len(restored) == 3 and aggregate(restored) == row
    assert aggregate(restored[:2])["images_per_second"] == 200.0   # a partly run row goes on from its trials


def test_resume_continues_a_file_written_before_a_setting_existed(tmp_path):
    """A file without a setting added since (--accumulate) ran with its default: --resume continues it, and refuses
    it for another value."""
    import compare
    from common.interface import RosettaError
    from harness.run.resume import previous_run, settings
    path = tmp_path / "run.json"
    args = compare.parse_args(["--json", str(path), "--resume"])
    written = {k: v for k, v in settings(args).items() if k != "accumulate"}
    path.write_text(json.dumps({"settings": written, "runs": []}))
    assert previous_run(args)["settings"] == written
    with pytest.raises(RosettaError, match=r"accumulate \[1\] there, \[4\] here"):
        previous_run(compare.parse_args(["--json", str(path), "--resume", "--accumulate", "4"]))
    # rows of another version of the code: every row of a file carries its one commit
    path.write_text(json.dumps({"settings": written, "runs": [], "environment": {"commit": "0000000"}}))
    with pytest.raises(RosettaError, match=r"written at commit 0000000, this checkout is at [0-9a-f]+: rows of two"):
        previous_run(args)
    path.write_text(json.dumps({"settings": written, "runs": []}))
    # rows trained on from a checkpoint are another run's than rows trained from the start: never mixed
    args.resume_from = str(tmp_path / "pytorch-scratch-2d-1p-epoch3.pt")
    with pytest.raises(RosettaError, match=r"resume_from None there, '.*epoch3.pt' here"):
        previous_run(args)


def test_resuming_a_finished_run_measures_nothing_and_keeps_its_environment(monkeypatch):
    """Nothing is left to run: the file's load record (where it ran, how busy) stays. A 15 ms window of load replaced
    it, and its warning said the run was not quiet, which the site then published."""
    from harness.run import trials
    monkeypatch.setattr(trials, "LoadRecord", lambda: pytest.fail("load measured for a run with nothing to run"))
    monkeypatch.setattr(trials, "write_results", lambda *args: "the rows as kept")
    env = {"load": {"other_cpu_seconds": 1.0}}
    assert trials.run_trials(None, env, None, [], ["r"], [[{"status": "ok"}]], [1]) == "the rows as kept"
    assert env == {"load": {"other_cpu_seconds": 1.0}}


def test_one_step_has_no_steady_state_throughput():
    from harness.training.loop import summarize
    record = {"epoch_loss_sums": [4.6], "epoch_sizes": [2], "epoch_seconds": [0.5], "step_loss_sums": [4.6],
              "step_sizes": [2], "first_step_seconds": 0.4, "first_step_images": 2, "images": 2,
              "test_accuracy": 0.1, "replica_spread": 0.0}
    assert summarize([record])["images_per_second"] is None   # not 0 images/s


def test_relative_paths_are_the_caller_s_not_the_workers(tmp_path, monkeypatch):
    """Workers run from the repo root: a relative --data-dir (or checkpoint path) given from elsewhere must
    be made absolute where compare.py was started, or the workers look in the wrong folder."""
    import compare
    monkeypatch.chdir(tmp_path)
    args = compare.parse_args(["--dataset", "fashion-mnist", "--data-dir", "idx", "--checkpoint-dir", "ckpt"])
    assert args.data_dir == str(tmp_path / "idx") and args.checkpoint_dir == str(tmp_path / "ckpt")


def test_every_bar_of_the_plot_names_its_row():
    """Two rows that differ only in their all-reduce (or layout, cores, precision, sharding, accumulation or the
    all-reduce dtype) get bars of different names: the per-tensor/bucketed run's plot showed each scratch row twice
    under one name."""
    from harness.publishing.plots import label
    row = {"framework": "jax", "mode": "scratch", "exec": "jax.jit", "layout": "NHWC/HWIO (lax)", "devices": 2,
           "processes": 2, "cores": "per-device", "trials": 3}
    variants = [row, {**row, "allreduce": "bucketed"}, {**row, "allreduce": "per-tensor"}, {**row, "layout": "NCHW"},
                {**row, "cores": "shared"}, {**row, "precision": "bf16"}, {**row, "shard": "optimizer"},
                {**row, "accumulate": 4}, {**row, "allreduce_dtype": "bf16"}]
    names = [label(r) for r in variants]
    assert len(set(names)) == 8 and names[0] == names[2]
    assert names[1] == "jax scratch jax.jit NHWC/HWIO 2d/2p, bucketed, core per device"


def test_the_csv_holds_every_column_the_table_shows(tmp_path):
    """usage.md: "--csv PATH holds every column of the printed tables". Rows of --per-device-batch 8,64 --devices 1,2
    (a batch column) and of --shard none,parameters (shard, params/device, opt. state/device columns) wrote CSV lines
    the same but for their speed: the file had none of those columns."""
    from harness.publishing.tables import OPTIONAL_COLUMNS, table_cells
    base = {"framework": "pytorch", "mode": "scratch", "exec": "eager", "layout": "NHWC", "processes": 1, "epochs": 1,
            "status": "ok", "images_per_second": 1000.0}
    batches = [{**base, "batch_size": b * d, "devices": d} for b in (8, 64) for d in (1, 2)]
    shards = [{**base, "batch_size": 256, "devices": 2, "shard": shard, "parameter_bytes_per_device": p,
               "optimizer_state_bytes_per_device": o}
              for shard, p, o in (("none", 246824, 246824), ("parameters", 123412, 123412))]
    fields = {heading: fields for *_, headings, _, fields in OPTIONAL_COLUMNS for heading in headings}
    for rows, headings in ((batches, ["batch"]), (shards, ["shard", "params/device", "opt. state/device"])):
        read = read_csv(tmp_path, rows)
        assert all(h in table_cells(rows)[0] for h in headings)
        assert all(f in read[0] for h in headings for f in fields[h]), list(read[0])
        assert len({tuple(line.values()) for line in read}) == len(rows)   # no two lines alike
    assert [line["batch_size"] for line in read_csv(tmp_path, batches)] == ["8", "16", "64", "128"]
    assert [(line["shard"], line["parameter_bytes_per_device"]) for line in read_csv(tmp_path, shards)] == [
        ("none", "246824"), ("parameters", "123412")]
    for rows, field in ((batches[:1], "batch_size"), (shards[:1], "shard")):   # a column only where the table has it
        assert field not in read_csv(tmp_path, rows)[0] and field not in table_cells(rows)[0]


def read_csv(tmp_path, rows):
    """The lines write_csv writes for `rows`, read back."""
    import csv
    from harness.studies.benchmark import write_csv
    write_csv(tmp_path / "rows.csv", rows, {})
    with open(tmp_path / "rows.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_bars_of_rows_of_several_batches_are_told_apart():
    """--per-device-batch 8,64: the plot labelled the 1-device rows of batch 8 and 64 alike."""
    from harness.publishing.plots import label
    row = {"framework": "pytorch", "mode": "scratch", "exec": "eager", "layout": "NHWC (channels_last)", "devices": 1,
           "processes": 1, "cores": "shared", "trials": 1}
    names = [label({**row, "batch_size": b}) for b in (8, 64, 256)]
    assert len(set(names)) == 3 and names[2] == label(row) == "pytorch scratch eager NHWC 1d/1p, 1 trial"
    assert names[0] == "pytorch scratch eager NHWC 1d/1p, batch 8, 1 trial"
    resnet = {**row, "model": "resnet18", "width": 8}
    assert label({**resnet, "bn": "local"}) != label({**resnet, "bn": "sync"})


def test_the_json_and_the_csv_may_not_name_one_file(tmp_path, capsys):
    """--json and --csv naming the same file: the CSV was written over the JSON, and --resume could not read it."""
    import compare
    from common.interface import RosettaError
    from harness.run.outputs import check_outputs
    same = str(tmp_path / "same.out")
    args = compare.parse_args(["--frameworks", "pytorch", "--json", same, "--csv", same])
    with pytest.raises(RosettaError, match="--json and --csv name the same file"):
        check_outputs(args)
    assert compare.main(["--frameworks", "pytorch", "--json", same, "--csv", str(tmp_path / ".." / tmp_path.name /
                                                                              "same.out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --json and --csv name the same file") and len(err.strip().splitlines()) == 1
    assert not os.path.exists(same)


def test_a_row_too_short_for_the_profile_s_window_is_said_once(tmp_path):
    """--profile traces the 3rd to 5th steps: a row of 2 steps (512 images, batch 256, one epoch) wrote no trace
    and said nothing. One line names it, before the first row (run_trials says profile_note's line once)."""
    import compare
    from harness.run.plan import row_label, run_specs
    from harness.run.trials import profile_note
    from harness.training.profile import WINDOW
    args = compare.parse_args(["--frameworks", "pytorch", "--mode", "scratch", "--devices", "2", "--processes", "2",
                               "--dataset", "synthetic", "--n-synthetic", "768", "--epochs", "1",
                               "--per-device-batch", "64,128,192", "--profile", str(tmp_path)])
    specs = list(run_specs(args))
    labels = [row_label(spec) for spec, _ in specs]
    err = profile_note(args, {"n_train": 768}, specs, labels, [[] for _ in specs], [1] * len(specs)).splitlines()
    assert WINDOW == "steps 3-5" and len(err) == 1, err   # 6 steps at batch 128: the window whole, not named
    assert err[0] == ("note: --profile traces steps 3-5 of each row, counted from 1; too few steps in "
                      "pytorch scratch (default), 2 device(s), 2 process(es): 3 step(s), step 3 only; "
                      "pytorch scratch (default), 2 device(s), batch 384, 2 process(es): 2 step(s), no trace")
