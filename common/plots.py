"""The benchmark figure: loss curves of every run overlaid (the same data and weights, so they should
coincide), and throughput bars with min-max whiskers over the trials."""
import os

import matplotlib

matplotlib.use("Agg")   # files only, no screen needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from .interface import RosettaError  # noqa: E402
from .report import replaced_atomically  # noqa: E402

COLORS = {"pytorch": "tab:red", "mxnet": "tab:blue", "tensorflow": "tab:orange"}


def label(r):
    return f"{r['framework']} {r['mode']} {r.get('exec') or ''} {r['devices']}d/{r['processes']}p".replace("  ", " ")


def image_format(path):
    """The format a figure is saved in, from the file's extension (png without one); a format matplotlib
    cannot write is a RosettaError, raised before the first row rather than after the last."""
    ext = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if ext not in formats:
        raise RosettaError(f"cannot write --plot {path}: matplotlib cannot write .{ext} files (it writes "
                           f"{', '.join(sorted(formats))})")
    return ext


def plot_runs(path, runs, title=""):
    ok = [r for r in runs if r["status"] == "ok"]
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(15, 6))
    for r in ok:
        losses = r.get("step_losses") or []
        curves.plot(range(1, len(losses) + 1), losses, color=COLORS.get(r["framework"]), alpha=0.6, label=label(r))
    curves.set(xlabel="training step", ylabel="training loss (global batch)", title="loss curves")
    curves.legend(fontsize=7)
    timed = [r for r in ok if r.get("images_per_second")]
    ips = [r["images_per_second"] for r in timed]
    low = [v - (r.get("images_per_second_min") or v) for v, r in zip(ips, timed)]
    high = [(r.get("images_per_second_max") or v) - v for v, r in zip(ips, timed)]
    bars.barh(range(len(timed)), ips, xerr=[low, high], capsize=3,
              color=[COLORS.get(r["framework"]) for r in timed])
    bars.set_yticks(range(len(timed)), [label(r) for r in timed], fontsize=7)
    bars.invert_yaxis()
    bars.set(xlabel="images/s (median; whiskers: min-max over trials)", title="training throughput")
    fig.suptitle(title)
    fig.tight_layout()
    with replaced_atomically(path, "wb") as f:
        fig.savefig(f, format=image_format(path), dpi=110)
    plt.close(fig)
