"""What a comparison prints and saves: the environment, the result table and the JSON file."""
import json
import os
import platform
import shutil
import subprocess
import sys

from .interface import FRAMEWORKS, installed_version

COLUMNS = ("framework", "mode", "devices", "processes", "epochs", "train s", "images/s",
           "test acc", "final loss", "|Δ step-1 loss|", "status")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names():
    """GPUs as nvidia-smi lists them (no framework import needed); empty on CPU-only machines."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def environment():
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "frameworks": {name: installed_version(name) for name in FRAMEWORKS},
        "numpy": installed_version_of("numpy"),
        "gpus": gpu_names(),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }


def installed_version_of(dist):
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def add_parity(runs):
    """Each ok run's distance from the first ok framework's first-step loss in the same configuration:
    identical weights and batches, so anything above float32 round-off is a translation bug."""
    reference = {}
    for run in runs:
        if run["status"] == "ok" and run.get("step_losses"):
            key = (run["mode"], run["devices"], run["processes"])
            first = run["step_losses"][0]
            reference.setdefault(key, (run["framework"], first))
            run["step1_loss_diff"] = abs(first - reference[key][1])
            run["parity_reference"] = reference[key][0]


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def format_table(runs):
    rows = []
    for r in runs:
        ok = r["status"] == "ok"
        rows.append([
            r["framework"], r["mode"], str(r["devices"]), str(r["processes"]), str(r["epochs"]),
            fmt(r.get("train_seconds"), ".1f"), fmt(r.get("images_per_second"), ",.0f"),
            fmt(r.get("test_accuracy"), ".4f"), fmt(r["epoch_losses"][-1] if ok and r.get("epoch_losses") else None,
                                                    ".4f"),
            fmt(r.get("step1_loss_diff"), ".1e"),
            r["status"] if ok else f"{r['status']}: {r.get('error')}",
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line(row) for row in rows])


def write_json(path, env, dataset, runs):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, "dataset": dataset, "runs": runs}, f, indent=2)
