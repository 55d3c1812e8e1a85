"""The linear scaling rule, measured: how the learning rate should follow the number of workers.

    python -m harness.studies.lr_scaling --data-dir /usr/share/datasets/fashion-mnist [--framework pytorch] [--out DIR]

Each device keeps its batch (--per-device-batch 64), so 1, 2, 4 and 8 devices train on global batches of 64 to
512 and take 8x fewer steps at 8 devices, for the same epochs (3 by default). Three settings, each a compare.py run over those device counts:
the base rate as it is (tuned for one device), the rate scaled linearly with the global batch (Goyal et al. 2017,
"Accurate, Large Minibatch SGD"), and the scaled rate reached through a linear warm-up. Writes DIR/lr-scaling.md (the
table of test accuracies, with this command, the commit and the date), .png (accuracy against devices) and the
three runs' .json (--resume goes on with an interrupted one). The frameworks compute the same update (tests/
test_optimizers.py), so one framework answers for all four.
"""
import argparse
import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..files import replaced_atomically  # noqa: E402
from ..loader import ROOT  # noqa: E402
from ..publishing.provenance import provenance, provenance_line  # noqa: E402

DEVICES = "1,2,4,8"
SETTINGS = {   # name: compare.py options
    "base rate": [],
    "linear scaling": ["--lr-scaling", "linear"],
    "linear scaling + warm-up": ["--lr-scaling", "linear", "--warmup-epochs", "1"],   # a third of the run
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m harness.studies.lr_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="the Fashion-MNIST IDX files")
    p.add_argument("--framework", default="pytorch")
    p.add_argument("--optimizer", default="momentum")
    p.add_argument("--lr", type=float, default=0.02, help="the base rate, for one device's batch")
    p.add_argument("--per-device-batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, help="compare.py's --threads (default: all cores)")
    p.add_argument("--out", default="results", help="folder for the table, plot and runs")
    return p.parse_args(argv)


def command(args, name):
    return [sys.executable, "compare.py", "--frameworks", args.framework, "--dataset", "fashion-mnist",
            "--data-dir", os.path.abspath(args.data_dir), "--devices", DEVICES, "--per-device-batch",
            str(args.per_device_batch), "--reference-batch", str(args.per_device_batch), "--optimizer",
            args.optimizer, "--lr", str(args.lr), "--epochs", str(args.epochs), *SETTINGS[name],
            "--json", os.path.abspath(json_path(args, name)), "--resume",
            *(["--threads", str(args.threads)] if args.threads else [])]


def json_path(args, name):
    return os.path.join(args.out, f"lr-scaling-{name.replace(' + ', '-').replace(' ', '-')}.json")


def accuracies(path):
    """devices -> (test accuracy, final training loss) of an ok row."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    return {r["devices"]: (r["test_accuracy"], r["epoch_losses"][-1]) for r in runs if r["status"] == "ok"}


def table(args, results):
    devices = [int(d) for d in DEVICES.split(",")]
    lines = [f"Fashion-MNIST, {args.framework} scratch, {args.optimizer} 0.9, base rate {args.lr:g} for a batch of "
             f"{args.per_device_batch}, {args.per_device_batch} images per device, {args.epochs} epochs; test accuracy "
             f"(final training loss). Made at {provenance_line(provenance())}.", "",
             "| setting | " + " | ".join(f"{d} device(s), batch {d * args.per_device_batch}, lr" for d in devices) + " |",
             "|---|" + "---|" * len(devices)]
    for name, result in results.items():
        cells = []
        for d in devices:
            lr = args.lr * d if "linear" in name else args.lr
            cells.append(f"{result[d][0]:.4f} ({result[d][1]:.3f}), {lr:g}" if d in result else "not run")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path, results):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        devices = sorted(result)
        ax.plot(devices, [result[d][0] for d in devices], marker="o", label=name)
    ax.set(xscale="log", xlabel="devices (the global batch grows with them)", ylabel="test accuracy",
           title="The linear scaling rule on Fashion-MNIST")
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.legend()
    fig.tight_layout()
    with replaced_atomically(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in SETTINGS:
        print(f"{name}: {' '.join(command(args, name)[1:])}", file=sys.stderr)
        proc = subprocess.run(command(args, name), cwd=ROOT)
        if proc.returncode not in (0, 1):   # 1: a row failed, which the table shows
            return proc.returncode
    results = {name: accuracies(json_path(args, name)) for name in SETTINGS}
    with replaced_atomically(os.path.join(args.out, "lr-scaling.md"), "w") as f:
        f.write(table(args, results))
    plot(os.path.join(args.out, "lr-scaling.png"), results)
    print(table(args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
