"""Turning repeated trials into honest numbers: medians with min and max, derived metrics computed from
the spec (FLOPs) rather than typed in, scaling efficiency, and the CSV file."""
import csv
import statistics

from .lenet import flops_per_image
from .report import replaced_atomically

ROW_KEY = ("framework", "mode", "exec", "layout", "devices", "processes")
TRIAL_METRICS = ("images_per_second", "train_seconds", "epoch_seconds_median", "input_seconds_median",
                 "first_step_seconds",
                 "startup_seconds", "test_accuracy", "peak_rss_bytes", "peak_device_memory_bytes")
CSV_COLUMNS = ("framework", "mode", "exec", "layout", "devices", "processes", "trials", "status",
               "images_per_second", "images_per_second_min", "images_per_second_max", "epoch_seconds_median",
               "input_seconds_median",
               "first_step_seconds", "startup_seconds", "gflops", "peak_fraction", "scaling_efficiency", "test_accuracy",
               "peak_rss_bytes", "peak_device_memory_bytes", "error")


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(trials):
    """One row from the trials of one configuration: the first trial's details, metrics as medians,
    throughput also as min and max; a configuration is ok only if every trial was."""
    row = dict(trials[0])
    row["trials"] = len(trials)
    failed = [t for t in trials if t["status"] != "ok"]
    if failed:
        row.update(status=failed[0]["status"], error=failed[0].get("error"))
        return row
    for metric in TRIAL_METRICS:
        row[metric] = median([t.get(metric) for t in trials])
    ips = [t["images_per_second"] for t in trials if t.get("images_per_second")]
    row["images_per_second_min"], row["images_per_second_max"] = (min(ips), max(ips)) if ips else (None, None)
    row["gflops"] = row["images_per_second"] * flops_per_image() / 1e9 if row["images_per_second"] else None
    if len(trials) > 1:   # each trial's metrics: what --resume restores the trials from
        row["trial_images_per_second"] = [t.get("images_per_second") for t in trials]
        row["trial_metrics"] = [{metric: t.get(metric) for metric in TRIAL_METRICS} for t in trials]
    return row


def add_scaling(rows):
    """Throughput at N devices / (N x throughput at 1 device), same framework, mode, exec, layout and processes."""
    single = {(r["framework"], r["mode"], r.get("exec"), r.get("layout")): r["images_per_second"]
              for r in rows if r["status"] == "ok" and r["devices"] == 1 and r["processes"] == 1}
    for r in rows:
        base = single.get((r["framework"], r["mode"], r.get("exec"), r.get("layout")))
        r["scaling_efficiency"] = (r["images_per_second"] / (r["devices"] * base)
                                   if r["status"] == "ok" and base and r.get("images_per_second") else None)


def write_csv(path, rows):
    with replaced_atomically(path, newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in CSV_COLUMNS})


def add_peak_fraction(rows, calibration):
    """Each row's GFLOP/s as a fraction of this machine's matmul peak measured in the same run (the mean of
    the figures taken so far: at the start, and at the end once the run is over). Absolute speed differs
    2x between machines of one kind; the fraction of the same run's peak does not."""
    peaks = [v for k, v in sorted((calibration or {}).items()) if k.startswith("matmul_peak_gflops")]
    peak = sum(peaks) / len(peaks) if peaks else None
    for r in rows:
        r["peak_fraction"] = r["gflops"] / peak if peak and r.get("gflops") else None
