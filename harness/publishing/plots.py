"""The benchmark figure: loss curves of every run overlaid (the same data and weights, so they should
coincide), and throughput bars with min-max whiskers over the trials (a row of one trial has none, and says
so)."""
import os

import matplotlib

matplotlib.use("Agg")   # files only, no screen needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from common.interface import RosettaError  # noqa: E402

from ..files import replaced_atomically  # noqa: E402
from ..spec import default, variant  # noqa: E402

COLORS = {"pytorch": "tab:red", "mxnet": "tab:blue", "tensorflow": "tab:orange", "jax": "tab:green"}


def label(r):
    cores = ", core per device" if r.get("cores") == "per-device" else ""
    trials = "" if r.get("trials", 1) > 1 else ", 1 trial"
    layout = (r.get("layout") or "").split(" ")[0]   # NCHW, NHWC: two rows may differ only there
    model = f" {r['model']} w{r.get('width')} {r.get('bn')} BN" if (r.get("model") or "lenet") != "lenet" else ""
    batch = f", batch {r['batch_size']}" if r.get("batch_size") not in (None, default("batch_size")) else ""
    return (f"{r['framework']}{model} {r['mode']} {r.get('exec') or ''} {layout} {r['devices']}d/{r['processes']}p"
            f"{batch}{variant(r)}{cores}{trials}")   # or only in their batch, BatchNorm, all-reduce, precision, ...


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
    timed = [r for r in ok if r.get("images_per_second")]
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(16, max(6, 0.28 * len(timed) + 2)),
                                       gridspec_kw={"width_ratios": (1, 1.3)})
    for r in ok:   # one legend entry per framework: the curves of one framework share its colour
        losses = r.get("step_losses") or []
        curves.plot(range(1, len(losses) + 1), losses, color=COLORS.get(r["framework"]), alpha=0.5, linewidth=0.8,
                    label=r["framework"])
    handles = {h.get_label(): h for h in curves.get_legend_handles_labels()[0]}
    curves.legend(handles.values(), handles.keys())
    curves.set(xlabel="training step", ylabel="training loss (global batch)",
               title=f"loss curves of all {len(ok)} runs (same data, same initial weights)")
    ips = [r["images_per_second"] for r in timed]
    several = [r.get("trials", 1) > 1 for r in timed]   # min-max whiskers only where there were trials to span
    low = [v - r["images_per_second_min"] if s else 0 for v, r, s in zip(ips, timed, several)]
    high = [r["images_per_second_max"] - v if s else 0 for v, r, s in zip(ips, timed, several)]
    bars.barh(range(len(timed)), ips, xerr=[low, high], capsize=3, color=[COLORS.get(r["framework"]) for r in timed],
              hatch=["" if s else "//" for s in several])
    bars.set_yticks(range(len(timed)), [label(r) for r in timed], fontsize=8)
    bars.invert_yaxis()
    bars.set(xlabel="images/s: median; whiskers min-max over the trials (hatched, no whisker: a single trial)",
             title="training throughput")
    fig.suptitle(title)
    fig.tight_layout()
    with replaced_atomically(path, "wb") as f:
        fig.savefig(f, format=image_format(path), dpi=110)
    plt.close(fig)
