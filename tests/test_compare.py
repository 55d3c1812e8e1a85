"""compare.py end to end, as a user runs it: a real small run, the JSON it writes, and bad input."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def compare(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "compare.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_small_pytorch_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "r.json"
    proc = compare("--frameworks", "pytorch", "--devices", "1,2", "--epochs", "2", "--batch-size", "128",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    env = report["environment"]
    assert {"python", "platform", "cpu", "frameworks", "gpus"} <= set(env)
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


def test_progress_bar_when_stdout_is_a_terminal():
    import pty
    import re
    main, replica = pty.openpty()
    proc = subprocess.Popen([sys.executable, "compare.py", "--frameworks", "pytorch", "--devices", "1",
                             "--epochs", "10"], cwd=ROOT, stdout=replica, stderr=subprocess.DEVNULL)
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
    proc = subprocess.run([sys.executable, "compare.py", "--frameworks", "mxnet", "--epochs", "1"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: mxnet is not installed" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--frameworks", "caffe"], "unknown framework 'caffe'"),
    (["--devices", "0"], "must be an integer >= 1"),
    (["--devices", "two"], "comma-separated integers"),
    (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent/dir"], "does not exist"),
    (["--epochs", "0"], "--epochs must be >= 1"),
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


def test_list_devices():
    proc = compare("--list-devices", "--frameworks", "pytorch", "--devices", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("pytorch: [") == 3


def test_parity_column_compares_across_frameworks_modes_and_exec_levels():
    from common.report import add_parity
    runs = [{"framework": f, "mode": m, "exec": e, "devices": d, "processes": p, "status": "ok", "step_losses": [l]}
            for f, m, e, d, p, l in [("pytorch", "scratch", "eager", 2, 1, 2.5), ("mxnet", "scratch", "hybridize", 2, 1, 2.5001),
                                     ("tensorflow", "builtin", "tf.function", 2, 2, 2.4)]]
    runs.append({"framework": "mxnet", "mode": "scratch", "status": "failed"})
    add_parity(runs)
    assert [r.get("step1_loss_diff") for r in runs] == [0.0, pytest.approx(1e-4), pytest.approx(0.1), None]
