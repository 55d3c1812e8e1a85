"""What a comparison prints: the environment and the result tables."""
import sys

from ..spec import SCHEDULE_FIELDS, default, default_lr

COLUMNS = ("framework", "mode", "exec", "layout", "devices", "processes", "epochs", "train s", "images/s",
           "test acc", "final loss", "|Δ step-1 loss|", "status")
MODEL_COLUMNS = ("model", "BN: running states")   # shown when a run trains the ResNet
TIMING_COLUMNS = ("framework", "mode", "exec", "compiles", "layout", "cores", "devices", "processes",
                  "images/s (min-max)", "epoch s", "input s (share)", "first step s", "start-up s", "GFLOP/s",
                  "of peak", "scaling", "train MiB", "test acc", "status")


def progress_bar(label):
    """A one-line bar, redrawn in place, when stdout is a terminal; nothing in logs and pipes."""
    if not sys.stdout.isatty():
        return None

    def show(step, steps):
        done = int(30 * step / max(steps, 1))
        print(f"\r  {label} [{'#' * done}{'.' * (30 - done)}] {step}/{steps}", end="", flush=True)
    return show


def add_parity(runs):
    """Each ok run's distance from the first-step loss of the first ok run that computes the same first step. The
    first step is the same arithmetic in every framework, mode, exec level and device or process count (the same
    weights, the same first global batch), so anything above float32 round-off is a translation bug. With
    BatchNorm, the statistics are part of the arithmetic, and its rows are compared among rows that cut the batch
    alike (batchnorm_groups). A bf16 row is compared among bf16 rows, whose first steps agree within bf16's rounding
    (common.precision.BOUND), not float32's."""
    ok = [r for r in runs if r["status"] == "ok" and r.get("step_losses") and not r.get("first_epoch")]   # a resumed
    # run's first step is another batch's
    references = {}
    for run in ok:
        reference = references.setdefault(same_first_step(run), run)
        run["step1_loss_diff"] = abs(run["step_losses"][0] - reference["step_losses"][0])
        run["parity_reference"] = (f"{reference['framework']} {reference['mode']} {reference['devices']}d/"
                                   f"{reference['processes']}p")


def same_first_step(r):
    """What decides a run's first-step loss beyond the weights: the first batch (its size: --per-device-batch rows
    differ), the network, how its BatchNorm cuts the batch and the precision it computes in (add_parity)."""
    return (r.get("batch_size"), r.get("model") or "lenet", r.get("width"), batchnorm_groups(r),
            r.get("precision") or "fp32")


def batchnorm_groups(r):
    """The parts of the batch a run's BatchNorm normalises apart. Local BatchNorm on N devices: each device's shard;
    synchronised, or on 1 device: the whole batch. Each forward pass has statistics of its own, so with --accumulate K
    every micro-batch is one more cut: local, each shard's K micro-batches apart; synchronised, the K micro-batches
    that each take a slice of every device's shard (not the batch's K contiguous parts that 1 device's are)."""
    if r.get("bn") is None:   # a network without BatchNorm: a micro-batch's loss adds to the batch's alike
        return "no BatchNorm"
    devices, k = r["devices"], r.get("accumulate") or 1
    if r["bn"] == "local" and devices > 1:
        return f"{devices} shards" + (f", {k} micro-batches each" if k > 1 else "")
    if k == 1:
        return "the whole batch"
    return f"{k} micro-batches" + (f" across {devices} devices" if devices > 1 else "")


def target_cell(r):
    """Seconds of training (evaluation left out) until the test accuracy, checked after every epoch, first reached
    --target-accuracy, and after how many epochs."""
    if r["status"] != "ok" or not r.get("target_accuracy"):
        return "-"
    if r.get("seconds_to_target") is None:
        return f"not in {r['epochs']} ep"
    since = f", timed from epoch {r['first_epoch']}" if r.get("first_epoch") else ""   # resumed: the rest not its own
    return f"{r['seconds_to_target']:.1f} ({r['epochs_to_target']} ep{since})"


def epochs_cell(r):
    """The run's epochs; a run resumed from a checkpoint trained (and timed) those after it only."""
    return f"{r['epochs']} (from {r['first_epoch']})" if r.get("first_epoch") else str(r["epochs"])


def has_resnet(runs):
    return any((r.get("model") or "lenet") != "lenet" for r in runs)


def has_buckets(runs):
    return any(r.get("allreduce") == "bucketed" for r in runs)


def several_batches(runs):
    return len({r.get("batch_size") for r in runs}) > 1


def sets(field):
    """Whether a row sets `field` to other than a run without its option has (harness/spec.py's default)."""
    plain = default(field)
    return lambda runs: any((r.get(field) or plain) != plain for r in runs)


def before(name):
    return lambda columns: columns.index(name)


def after(name):
    return lambda columns: columns.index(name) + 1


def allreduce_cell(r):
    """How the scratch step summed the gradients (--allreduce); an engine sums them its own way ("-"), but for the
    one that runs --allreduce bucketed (JAX's psum, written by hand: the plan refuses it to the others)."""
    if r["mode"] == "scratch" or r.get("allreduce") == "bucketed":
        return r.get("allreduce") or "per-tensor"
    return "-"


def bytes_cell(n):
    """A byte count to read at a glance: KiB below a MiB, else MiB ('-': not measured)."""
    if n is None:
        return "-"
    return f"{n / 2**10:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.2f} MiB"


def model_cells(r):
    """The network, and for BatchNorm its mode and how many different running states the replicas ended with."""
    if (r.get("model") or "lenet") == "lenet":
        return ["lenet", "-"]
    states = f": {r['bn_states']} of {r['bn_replicas']}" if r.get("bn_replicas") else ""
    return [f"{r['model']} w{r['width']}", f"{r['bn']}{states}"]


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def one_line(error):
    """A row's error as one line of the table (the JSON keeps it whole): TensorFlow's graph errors carry the Python
    stack of every op's definition ("Detected at node ... File ...") and the node between their first line and their
    cause; those lines are left out."""
    if error is None:
        return None
    frames = ("File ", "Detected at node", "Traceback", "[[")
    return " ".join(line.strip() for line in str(error).splitlines()
                    if line.strip() and not line.strip().startswith(frames))


def status(r):
    text = r["status"] if r["status"] == "ok" else f"{r['status']}: {one_line(r.get('error'))}"
    if r.get("restarts"):   # --max-restarts: the run came back from its last checkpoint
        lost = f", {r['lost_seconds']:.1f} s lost" if r.get("lost_seconds") is not None else ""
        text += f" after {r['restarts']} restart(s){lost}"
    return text


def processes_cell(r):
    """The run's processes, and over how many hosts when more than one (--hosts)."""
    hosts = len(r.get("hosts") or ())
    return f"{r['processes']} on {hosts} hosts" if hosts > 1 else str(r["processes"])


def row_cells(r):
    ok = r["status"] == "ok"
    return [r["framework"], r["mode"], r.get("exec") or "-", r.get("layout") or "-", str(r["devices"]),
            processes_cell(r), epochs_cell(r),
            fmt(r.get("train_seconds"), ".1f"), fmt(r.get("images_per_second"), ",.0f"),
            fmt(r.get("test_accuracy"), ".4f"),
            fmt(r["epoch_losses"][-1] if ok and r.get("epoch_losses") else None, ".4f"),
            fmt(r.get("step1_loss_diff"), ".1e"), status(r)]


def timing_cells(r):
    ips = fmt(r.get("images_per_second"), ",.0f")
    if r.get("images_per_second_min") is not None and r.get("trials", 1) > 1:
        ips += f" ({r['images_per_second_min']:,.0f}-{r['images_per_second_max']:,.0f})"
    memory = r.get("train_memory_bytes")
    return [r["framework"], r["mode"], r.get("exec") or "-", r.get("compiles") or "-", r.get("layout") or "-",
            cores_cell(r),
            str(r["devices"]), processes_cell(r), ips,
            fmt(r.get("epoch_seconds_median"), ".2f"), input_cell(r), fmt(r.get("first_step_seconds"), ".2f"),
            fmt(r.get("startup_seconds"), ".1f"), fmt(r.get("gflops"), ".1f"),
            fmt(100 * r["peak_fraction"] if r.get("peak_fraction") else None, ".0f") + ("%" if r.get("peak_fraction") else ""),
            fmt(r.get("scaling_efficiency"), ".2f"),
            fmt(memory / 2**20 if memory else None, ",.0f"), fmt(r.get("test_accuracy"), ".4f"), status(r)]


def cores_cell(r):
    """How the run's processes used the cores (harness/processes/cores.py): all threads shared by every op, or a
    number of cores of its own for each device."""
    threads = r.get("threads")
    if r.get("cores") == "per-device":
        return f"{threads * r['processes'] // r['devices']} per device" if threads else "per device"
    return f"shared, {threads}" + (f" x {r['processes']}" if r["processes"] > 1 else "") if threads else "shared"


def input_cell(r):
    """Seconds per epoch the loop waited for its input pipeline's next batch (median), and their share of
    the epoch: what feeding the devices costs (numpy slicing in the scratch mode, the framework's own
    pipeline in the built-in mode). Asynchronous engines (MXNet, JAX) may still be finishing the previous
    step while the loop waits: their figure can include some of that."""
    wait, epoch = r.get("input_seconds_median"), r.get("epoch_seconds_median")
    return "-" if wait is None or not epoch else f"{wait:.3f} ({wait / epoch:.1%})"


def timing_view(settings):
    """Whether a run's table is the timing view: it repeated trials or was the benchmark. `settings` is the
    command's options as a mapping (vars(args), or the "settings" its JSON file stores), so the printed table
    and the one published from the file (harness/publishing/published.py) are the same view."""
    return settings.get("repeats", 1) > 1 or bool(settings.get("benchmark"))


def format_table(runs, timing=False, markdown=False):
    """A markdown table: the comparison (default) or the timing view (benchmarks, repeated trials).
    markdown=True escapes a `|` inside a cell (the |Δ step-1 loss| heading) as GitHub's tables need; the
    terminal gets the plain text."""
    return render(*table_cells(runs, timing), markdown=markdown)


# The columns a table shows only where a row needs them, in the order they are put in (each "after the layout" goes
# in next to it): (shown(rows), where, headings, the row's cells, the CSV's fields that hold the same). The CSV
# (harness/studies/benchmark.py write_csv) leaves those fields out where the table leaves the columns out.
OPTIONAL_COLUMNS = (
    (several_batches, before("devices"), ["batch"], lambda r: [str(r.get("batch_size") or "-")],   # global batches
     ("batch_size",)),
    (has_buckets, after("layout"), ["all-reduce"], lambda r: [allreduce_cell(r)],   # per parameter or per bucket
     ("allreduce",)),
    (sets("allreduce_dtype"), after("layout"), ["all-reduce dtype"],   # the gradients' sum
     lambda r: [r.get("allreduce_dtype") or "fp32"], ("allreduce_dtype",)),
    (sets("precision"), after("layout"), ["precision"], lambda r: [r.get("precision") or "fp32"],   # the network's
     ("precision",)),
    (sets("shard"), after("layout"), ["shard", "params/device", "opt. state/device"],   # ZeRO's stage, what it keeps
     lambda r: [r.get("shard") or "none", bytes_cell(r.get("parameter_bytes_per_device")),
                bytes_cell(r.get("optimizer_state_bytes_per_device"))],
     ("shard", "parameter_bytes_per_device", "optimizer_state_bytes_per_device")),
    (sets("accumulate"), after("layout"), ["accumulate"], lambda r: [str(r.get("accumulate") or 1)],   # micro-batches
     ("accumulate",)),
    (has_resnet, after("framework"), MODEL_COLUMNS, model_cells,   # the network, its BatchNorm's distinct states
     ("model", "width", "bn", "bn_states", "bn_replicas")),
)


def table_cells(runs, timing=False):
    """The table's headings and its rows of cells, before rendering: a published run shows some of them
    (harness/publishing/published.py), so its cells are the ones compare.py prints."""
    columns, cells = (TIMING_COLUMNS, timing_cells) if timing else (COLUMNS, row_cells)
    rows = [cells(r) for r in runs]
    targets = sorted({r["target_accuracy"] for r in runs if r.get("target_accuracy")})
    if targets:   # before the test accuracy: the time to reach the target accuracy
        at = columns.index("test acc")
        columns = (*columns[:at], f"s to {'/'.join(f'{t:g}' for t in targets)} acc", *columns[at:])
        rows = [[*row[:at], target_cell(r), *row[at:]] for row, r in zip(rows, runs)]
    for shown, at, names, cells, _ in OPTIONAL_COLUMNS:
        if shown(runs):
            i = at(columns)
            columns = (*columns[:i], *names, *columns[i:])
            rows = [[*row[:i], *cells(r), *row[i:]] for row, r in zip(rows, runs)]
    return list(columns), rows


def render(columns, rows, markdown=False):
    """Headings and rows of cells as a table padded to its columns' widths."""
    if markdown:
        columns, rows = escape_pipes(columns), [escape_pipes(row) for row in rows]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(columns)]
    line = lambda items: "| " + " | ".join(c.ljust(w) for c, w in zip(items, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def escape_pipes(cells):
    return [c.replace("|", "\\|") for c in cells]


def format_scaling(runs):
    """The scaling rows alone, framework by framework: throughput on N devices (or processes) against N x its
    1-device row, with the cores shared or a core per device, so concurrent and serial replicas show apart."""
    rows = sorted((r for r in runs if r.get("scaling_efficiency") is not None and r["devices"] > 1),
                  key=lambda r: (r["framework"], r.get("cores") != "shared"))
    lines = [f"| framework | cores | run | images/s | 1-device row | its images/s | efficiency{rounds_heading(rows)} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['framework']} | {cores_cell(r)} | {r['mode']} ({r.get('exec')}), {r['devices']} devices, "
                     f"{r['processes']} process(es) | {r['images_per_second']:,.0f} | {r['scaling_base']} | "
                     f"{r['scaling_base_images_per_second']:,.0f} | {scaling_cell(r)} |")
    return "\n".join(lines) if rows else ""


PRECISION_KEY = ("framework", "model", "width", "bn", "mode", "exec", "layout", "allreduce", "shard", "accumulate",
                 "allreduce_dtype", "devices", "processes", "cores")   # what a low-precision row and its fp32 row share


def precision_ratios(rows):
    """Each ok bf16 or fp16 row against its fp32 row of the same run: (row, fp32 row, speed ratio, training-memory
    ratio, peak-RSS ratio), the ratios low / fp32 (a speed ratio above 1: the low precision is faster)."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("images_per_second")]
    out = []
    for r in ok:
        if r.get("precision", "fp32") == "fp32":
            continue
        base = [b for b in ok
                if b.get("precision", "fp32") == "fp32" and all(b.get(k) == r.get(k) for k in PRECISION_KEY)]
        if base:
            b = base[0]
            ratio = lambda key: r[key] / b[key] if r.get(key) and b.get(key) else None   # noqa: E731
            out.append((r, b, ratio("images_per_second"), ratio("train_memory_bytes"), ratio("peak_rss_bytes")))
    return out


def precision_cells(rows):
    """What a low precision buys in a run, as headings and rows of cells: each ok bf16 or fp16 row against its fp32
    row (precision_ratios), speed and memory as ratios low / fp32, and both rows' test accuracy."""
    header = ["framework", "run", "precision", "images/s", "fp32 images/s", "speed x", "training memory x",
              "peak RSS x", "test acc", "fp32 test acc"]
    body = [[r["framework"], f"{r['mode']} ({r.get('exec')}), {r['devices']} device(s), {r['processes']} process(es)",
             r["precision"], f"{r['images_per_second']:,.0f}", f"{b['images_per_second']:,.0f}", fmt(speed, ".2f"),
             fmt(memory, ".2f"), fmt(rss, ".2f"), fmt(r.get("test_accuracy"), ".4f"), fmt(b.get("test_accuracy"), ".4f")]
            for r, b, speed, memory, rss in precision_ratios(rows)]
    return header, body


def format_precision(rows):
    """precision_cells as a table, or "" where the run has no low-precision row with an fp32 row beside it."""
    header, body = precision_cells(rows)
    return render(header, body) if body else ""


def rounds_heading(rows):
    return " (lowest-highest round)" if any(r.get("scaling_efficiency_min") is not None for r in rows) else ""


def scaling_cell(r):
    """The scaling, and the lowest and highest of its rounds (each trial against its base's of the same round)."""
    spread = f" ({r['scaling_efficiency_min']:.2f}-{r['scaling_efficiency_max']:.2f})" \
        if r.get("scaling_efficiency_min") is not None else ""
    return f"{r['scaling_efficiency']:.2f}{spread}"


def format_split(rows):
    """The split as a markdown table, milliseconds and shares of the step; the rest in its two measured parts where
    the row's processes also ran alongside each other, and the row's speed against theirs in lockstep (both measured
    within minutes, so less at the mercy of the machine's drift than the scaling, whose base ran earlier)."""
    header, body = split_cells(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells[:-1]) + " |" + (f" {cells[-1]} |" if cells[-1] else " |")   # an empty last
              for cells in body]                                                                       # cell: "| |"
    return "\n".join(lines) if body else ""


def split_cells(rows):
    """The split's headings and its rows of cells (format_split), one row for each row that has a split."""
    rows = [r for r in rows if r.get("step_split")]
    parted = any("lockstep" in r["step_split"] for r in rows)
    more = ["sharing the machine", "waiting for the slower step"] if parted else []
    header = ["framework", "cores", "run", "step ms", "compute", "all-reduce alone", "input", *more,
              "rest" if parted else "rest (waiting)",
              "scaling" + rounds_heading(rows), *(["against them alongside"] if parted else [])]
    body = []
    for r in rows:
        s = r["step_split"]
        cell = lambda part: f"{1e3 * s[part]:.1f} ({s[part] / s['step']:.0%})" if part in s else ""   # noqa: E731
        parts = ["compute", "allreduce", "input", *(["sharing", "lockstep"] if parted else []), "rest"]
        against = [f"{r['lockstep_seconds'] / s['step']:.2f}" if "lockstep" in s else ""] if parted else []
        body.append([r["framework"], cores_cell(r), f"{r['mode']} ({r.get('exec')}), {r.get('allreduce_alone_pattern')} "
                     f"all-reduce, {r['devices']} devices, {r['processes']} processes", f"{1e3 * s['step']:.1f}",
                     *map(cell, parts), scaling_cell(r), *against])
    return header, body


def schedule_shape(args):
    """The schedule's own options given other than their defaults (harness/spec.py SCHEDULE_FIELDS), in brackets; ""
    otherwise. A file written before they were options ran with the defaults."""
    given = {name: default(name) for name in SCHEDULE_FIELDS}
    given.update((k, tuple(v) if isinstance(v, list) else v) for k, v in vars(args).items() if k in given)   # JSON
    words = {"lr_decay_factor": lambda v: f"x{v:g}",
             "lr_decay_at": lambda v: f"at epochs {', '.join(f'{e:g}' for e in v)}",
             "lr_decay_every": lambda v: f"every {v:g} epochs", "lr_power": lambda v: f"power {v:g}",
             "lr_final": lambda v: f"to {v:g}"}
    said = [say(given[name]) for name, say in words.items() if given[name] != default(name)]
    return f" ({', '.join(said)})" if said else ""


def optimizer_name(args):
    """The optimizer with what sets it apart: momentum's value, rmsprop's centring, momentum and alpha."""
    if args.optimizer in ("momentum", "nesterov"):
        return f"{args.optimizer} {args.momentum:g}"
    if args.optimizer != "rmsprop":
        return args.optimizer
    alpha = getattr(args, "rmsprop_alpha", 0.99)
    return " ".join(["rmsprop", *(["centered"] if getattr(args, "rmsprop_centered", False) else []),
                     *([f"momentum {args.momentum:g}"] if args.momentum else []),
                     *([f"alpha {alpha:g}"] if alpha != 0.99 else [])])


def optimizer_line(args):
    """The training options above the table, unless they are the recipe's (plain SGD, constant rate): None then."""
    if (args.optimizer, args.lr_schedule, args.warmup_epochs, args.weight_decay, args.clip_norm,
            getattr(args, "lr_scaling", "none")) == ("sgd", "constant", 0, 0, None, "none"):
        return None
    lr = args.lr if args.lr is not None else default_lr(getattr(args, "model", "lenet"), args.optimizer)
    parts = [optimizer_name(args),
             f"lr {lr:g}"
             + (f" x batch / {args.reference_batch}" if args.lr_scaling == "linear" else ""),
             f"{args.lr_schedule} schedule" + schedule_shape(args)]
    if args.warmup_epochs:
        parts.append(f"warm-up {args.warmup_epochs:g} epoch(s)")
    if args.weight_decay:
        parts.append(f"weight decay {args.weight_decay:g}" + (" (decoupled)" if args.optimizer == "adamw" else ""))
    if args.clip_norm:
        parts.append(f"clip norm {args.clip_norm:g}")
    return "optimizer: " + ", ".join(parts)
