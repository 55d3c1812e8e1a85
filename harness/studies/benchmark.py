"""Turning repeated trials into honest numbers: medians with min and max, derived metrics computed from
the spec (FLOPs) rather than typed in, scaling efficiency, and the CSV file."""
import csv
import statistics

from common.models import flops_per_image, parameter_count
from common.precision import wire_bytes

from ..publishing.provenance import CSV_COLUMNS
from ..files import replaced_atomically
from ..publishing.tables import OPTIONAL_COLUMNS

ROW_KEY = ("framework", "model", "width", "bn", "mode", "exec", "layout", "allreduce", "shard", "accumulate",
           "precision", "allreduce_dtype", "batch_size", "devices", "processes", "cores")
TRIAL_METRICS = ("images_per_second", "train_seconds", "epoch_seconds_median", "input_seconds_median",
                 "first_step_seconds",
                 "startup_seconds", "test_accuracy", "seconds_to_target", "peak_rss_bytes", "train_memory_bytes",
                 "peak_device_memory_bytes", "allreduce_alone_seconds", "alongside_seconds", "lockstep_seconds")
# The CSV: every column of the printed tables, unformatted but rounded to what the measurement can say.
# (name, value of a row, decimals): None decimals keeps the value as it is.
CSV_FIELDS = (
    ("framework", lambda r: r["framework"], None),
    ("model", lambda r: r.get("model") or "lenet", None), ("width", lambda r: r.get("width"), None),
    ("bn", lambda r: r.get("bn"), None), ("bn_states", lambda r: r.get("bn_states"), None),
    ("bn_replicas", lambda r: r.get("bn_replicas"), None),
    ("mode", lambda r: r["mode"], None),
    ("exec", lambda r: r.get("exec"), None), ("compiles", lambda r: r.get("compiles"), None),
    ("layout", lambda r: r.get("layout"), None), ("allreduce", lambda r: r.get("allreduce"), None),
    ("shard", lambda r: r.get("shard", "none"), None),
    ("parameter_bytes_per_device", lambda r: r.get("parameter_bytes_per_device"), None),
    ("optimizer_state_bytes_per_device", lambda r: r.get("optimizer_state_bytes_per_device"), None),
    ("accumulate", lambda r: r.get("accumulate", 1), None), ("precision", lambda r: r.get("precision", "fp32"), None),
    ("allreduce_dtype", lambda r: r.get("allreduce_dtype", "fp32"), None),
    ("allreduce_bytes", lambda r: r.get("allreduce_bytes"), None),
    ("cores", lambda r: r.get("cores"), None), ("threads_per_process", lambda r: r.get("threads"), None),
    ("batch_size", lambda r: r.get("batch_size"), None),
    ("devices", lambda r: r["devices"], None), ("processes", lambda r: r["processes"], None),
    ("hosts", lambda r: len(r["hosts"]) if r.get("hosts") else None, None),
    ("epochs", lambda r: r.get("epochs"), None), ("trials", lambda r: r.get("trials"), None),
    ("status", lambda r: r["status"], None),
    ("restarts", lambda r: r.get("restarts"), None), ("lost_seconds", lambda r: r.get("lost_seconds"), 1),
    ("images_per_second", lambda r: r.get("images_per_second"), 1),
    ("images_per_second_min", lambda r: r.get("images_per_second_min"), 1),
    ("images_per_second_max", lambda r: r.get("images_per_second_max"), 1),
    ("train_seconds", lambda r: r.get("train_seconds"), 3),
    ("epoch_seconds_median", lambda r: r.get("epoch_seconds_median"), 3),
    ("input_seconds_median", lambda r: r.get("input_seconds_median"), 4),
    ("first_step_seconds", lambda r: r.get("first_step_seconds"), 3),
    ("startup_seconds", lambda r: r.get("startup_seconds"), 2),
    ("gflops", lambda r: r.get("gflops"), 2), ("peak_fraction", lambda r: r.get("peak_fraction"), 4),
    ("scaling_efficiency", lambda r: r.get("scaling_efficiency"), 3),
    ("scaling_efficiency_min", lambda r: r.get("scaling_efficiency_min"), 3),
    ("scaling_efficiency_max", lambda r: r.get("scaling_efficiency_max"), 3),
    ("scaling_base", lambda r: r.get("scaling_base"), None),
    ("scaling_base_images_per_second", lambda r: r.get("scaling_base_images_per_second"), 1),
    *((f"{part}_ms", lambda r, part=part: 1e3 * r["step_split"][part] if part in r.get("step_split", {}) else None,
       2)
      for part in ("step", "allreduce", "compute", "input", "sharing", "lockstep", "rest")),
    ("train_memory_mib", lambda r: mib(r.get("train_memory_bytes")), 0),
    ("peak_rss_mib", lambda r: mib(r.get("peak_rss_bytes")), 0),
    ("peak_device_memory_mib", lambda r: mib(r.get("peak_device_memory_bytes")), 0),
    ("test_accuracy", lambda r: r.get("test_accuracy"), 4),
    ("target_accuracy", lambda r: r.get("target_accuracy"), None),
    ("seconds_to_target", lambda r: r.get("seconds_to_target"), 1),
    ("epochs_to_target", lambda r: r.get("epochs_to_target"), None),
    ("final_loss", lambda r: r["epoch_losses"][-1] if r.get("epoch_losses") else None, 5),
    ("step1_loss_diff", lambda r: r.get("step1_loss_diff"), "e"),
    ("error", lambda r: r.get("error"), None),
)
# A column no row has a value for is left out of a file (write_csv): device memory exists only on GPUs, errors only
# when a row failed, the hosts only in a run over several, the share of peak only in a timed run. The fields of the
# columns a table shows only where a row needs them (tables.OPTIONAL_COLUMNS: the network and its BatchNorm, several
# batches, bucketed all-reduces, a precision, all-reduce dtype, sharding or accumulation a row sets) are left out
# where the table leaves those out: each field by the test of its table column.
SHOWN_WHERE = {field: shown for shown, *_, fields in OPTIONAL_COLUMNS for field in fields}


def mib(n):
    return n / 2**20 if n else None


def rounded(value, decimals):
    if value is None or decimals is None:
        return value
    return float(f"{value:.2e}") if decimals == "e" else round(value, decimals) if decimals else round(value)


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
    flops = flops_per_image(row.get("model") or "lenet", row.get("width"))
    row["gflops"] = row["images_per_second"] * flops / 1e9 if row["images_per_second"] else None
    if row.get("devices", 1) > 1:   # what each device sends into the all-reduce per step, in the wire's dtype
        row["allreduce_bytes"] = wire_bytes(parameter_count(row.get("model") or "lenet", row.get("width")),
                                            row.get("allreduce_dtype", "fp32"))
    if len(trials) > 1:   # each trial's metrics: what --resume restores the trials from
        row["trial_images_per_second"] = [t.get("images_per_second") for t in trials]
        row["trial_metrics"] = [{metric: t.get(metric) for metric in TRIAL_METRICS} for t in trials]
    return row


# what a row and its 1-device base share, beside the batch each device computes (scaling_base)
SCALING_KEY = ("framework", "model", "width", "bn", "mode", "exec", "layout", "allreduce", "shard", "accumulate",
               "precision", "cores")


def add_scaling(rows):
    """Throughput at N devices / (N x throughput at 1 device): the 1-device row of the same settings (SCALING_KEY)
    and batch per device (scaling_base). A built-in engine timed only on several devices is compared with its
    framework's scratch step on 1 device in the same cores setting and batch, when exactly one such row exists
    (`scaling_base` says so)."""
    single = [r for r in rows if r["status"] == "ok" and r["devices"] == 1 and r["processes"] == 1
              and r.get("images_per_second")]
    for r in rows:
        base = scaling_base(r, single)
        ok = r["status"] == "ok" and base and r.get("images_per_second")
        r["scaling_efficiency"] = r["images_per_second"] / (r["devices"] * base["images_per_second"]) if ok else None
        batch = f", batch {base['batch_size']}" if ok and base.get("batch_size") != r.get("batch_size") else ""
        r["scaling_base"] = f"{base['mode']} ({base['exec']}), 1 device{batch}" if ok else None
        r["scaling_base_images_per_second"] = base["images_per_second"] if ok else None
        rounds = paired_rounds(r, base) if ok else None
        r["scaling_rounds"] = rounds
        r["scaling_efficiency_min"], r["scaling_efficiency_max"] = (min(rounds), max(rounds)) if rounds else (None, None)


def scaling_base(r, single):
    """The 1-device row among `single` that row r's scaling is against, or None. Its batch is r's batch per device
    where such a row exists (--per-device-batch: each device keeps its batch), else r's batch (--batch-size: the
    devices share one batch). Rows of --per-device-batch 8,64 on 2 devices were against the row of batch 8 alike."""
    batch = r.get("batch_size")
    for size in dict.fromkeys([batch / r["devices"] if batch else batch, batch]):
        same = [b for b in single if b.get("batch_size") == size]
        like = [b for b in same if all(b.get(k) == r.get(k) for k in SCALING_KEY)]
        scratch = [b for b in same if (b["framework"], b["mode"], b.get("cores"), b.get("precision")) ==
                   (r["framework"], "scratch", r.get("cores"), r.get("precision"))]
        if like or len(scratch) == 1:
            return like[0] if like else scratch[0]
    return None


def paired_rounds(row, base):
    """The scaling of each round of --repeats: trial k of the row against trial k of its base. Trials are
    interleaved, so each pair ran within one pass over the rows, minutes apart, while a run's first and last
    rounds may be an hour apart: their spread is the machine's drift over the run, which one median hides."""
    ours, theirs = row.get("trial_images_per_second"), base.get("trial_images_per_second")
    if not ours or not theirs or len(ours) != len(theirs) or None in ours or None in theirs:
        return None
    return [a / (row["devices"] * b) for a, b in zip(ours, theirs)]


def write_csv(path, rows, env):
    """One line a row, each with the run's provenance (`env`'s CSV_COLUMNS): a CSV travels without its JSON."""
    where = {name: env.get(name) for name in CSV_COLUMNS}
    table = [{**{name: rounded(value(r), decimals) for name, value, decimals in CSV_FIELDS}, **where} for r in rows]
    columns = [name for name, _, _ in CSV_FIELDS   # a column no row fills is left out (GPU memory on a CPU, ...)
               if any(t[name] is not None for t in table)
               and (name not in SHOWN_WHERE or SHOWN_WHERE[name](rows))
               ] + list(CSV_COLUMNS)
    with replaced_atomically(path, newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)


def add_peak_fraction(rows, calibration):
    """Each row's GFLOP/s as a fraction of this machine's matmul peak measured in the same run (the mean of
    the figures taken so far: at the start, and at the end once the run is over). Absolute speed differs
    2x between machines of one kind; the fraction of the same run's peak does not. A bf16 or fp16 row's fraction
    is of the matmul peak in its own precision (calibration.low_matmul_peaks): what the hardware offers it. Where the
    run measured PyTorch's fp32 peak beside it (every timed run does where PyTorch is installed: trials.calibrate)
    and that is higher, an fp32 row's fraction is of that one: numpy's BLAS may not know the CPU (on an Intel Xeon
    with AMX, numpy 1.26's OpenBLAS reached 35-41 GFLOP/s and PyTorch 267, and rows of 90 GFLOP/s were "234% of
    peak"), and the fp32 and bf16 rows are then measured against one library."""
    calibration = calibration or {}
    peaks = [v for k, v in sorted(calibration.items()) if k.startswith("matmul_peak_gflops")]
    low = calibration.get("low_matmul_peaks_gflops") or {}
    peak = max(sum(peaks) / len(peaks), low.get("fp32", 0.0)) if peaks else low.get("fp32")
    for r in rows:
        own = peak if r.get("precision", "fp32") == "fp32" else low.get(r["precision"])
        r["peak_fraction"] = r["gflops"] / own if own and r.get("gflops") else None
