"""Train the same LeNet, data-parallel, in every framework on identical data and compare.

    python compare.py                          # all frameworks, digits, 2 devices
    python compare.py --dataset fashion-mnist  # the recipe's data set (see README)
    python compare.py --mode scratch,builtin --processes 1,2   # the frameworks' own engines too
    python compare.py --benchmark              # the timing table: table, CSV, JSON and PNG
    python compare.py --list-devices           # what each framework sees
    python compare.py --merge out-*.json       # the table of a hand-launched run (torchrun, TF_CONFIG, DMLC_*)

Each run happens in its own process (common/worker.py): thread counts are fixed before the framework
is imported, and a framework that crashes or is missing costs only its own row. The requested files are
rewritten after every finished row, so an interrupted run keeps its finished rows (--resume goes on).
"""
import argparse
import itertools
import json
import os
import signal
import sys

from common.benchmark import ROW_KEY, add_peak_fraction, add_scaling, aggregate, write_csv
from common.calibration import LoadRecord, matmul_peak, warning
from common.checkpoints import check_resume
from common.cores import CORES, per_device_threads
from common.data import DATASETS, load_dataset
from common.interface import FRAMEWORKS, RosettaError
from common.launch import PROCESS_PER_DEVICE, raise_on_signals, run_workers
from common.lenet import INITS
from common.report import (add_parity, environment, environment_line, format_scaling, format_table, is_stream,
                           replaced_atomically, unwritable, write_json)
from common.training import MODES, summarize

DEFAULT_EPOCHS = {"digits": 30}   # small data: few steps per epoch; the recipe's 10 elsewhere
EXEC_LEVELS = ("default", "eager", "graph", "xla")
LAYOUTS = ("default", "nchw", "nhwc")   # memory layout of images and conv kernels: channels first or last
# --benchmark: synthetic images, batch 256, 3 trials. With the cores shared (every op may use every core):
# every execution mode on one device, the idiomatic reference loops, the default mode and the built-in engines
# (fed by their frameworks' own input pipelines) on 2 devices. With a core per device: the default mode on
# 1 device, 2 devices and 2 processes, and the built-in engines on 2 processes: real parallel speed-up, if any.
# And the scratch step in channels-first memory (NCHW), against the rows above in each framework's default
# layout (channels-last but in MXNet, whose NCHW row is then the same run twice: the noise between two rows).
# Plan entries: (mode, exec levels, (devices, processes) shapes, cores, layouts).
BENCHMARK_MD = os.path.join("results", "benchmark.md")
BENCHMARK = {"dataset": "synthetic", "n_synthetic": 30000, "epochs": 1, "batch_size": 256, "repeats": 3,
             "plan": [("scratch", ("eager", "graph", "xla"), ((1, 1),), "shared", ("default",)),
                      ("scratch", ("default",), ((1, 1),), "shared", ("nchw",)),
                      ("idiomatic", ("default",), ((1, 1),), "shared", ("default",)),
                      ("scratch", ("default",), ((2, 1),), "shared", ("default",)),
                      ("builtin", ("default",), ((2, 1),), "shared", ("default",)),
                      ("scratch", ("default",), ((1, 1), (2, 1), (2, 2)), "per-device", ("default",)),
                      ("builtin", ("default",), ((2, 2),), "per-device", ("default",))]}
SPEC_FIELDS = ("framework", "mode", "exec", "layout", "devices", "processes", "cores", "epochs", "batch_size",
               "lr", "seed", "init", "threads")
# What decides a run's rows and numbers: --resume continues a file only if all of these are the same.
SETTINGS = ("frameworks", "mode", "exec", "layout", "devices", "processes", "cores", "dataset", "n_synthetic",
            "epochs", "batch_size", "lr", "seed", "init", "threads", "repeats", "benchmark")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, not the whole usage block: the problem and where to look."""
        self.exit(2, f"error: {message} (see python compare.py --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default, except those that say nothing (no value, a flag that is off)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every count must be an integer >= 1, got {text!r}")
    return values


def name_list(choices, what):
    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad)) or repr(text)}; "
                                             f"choose from {', '.join(choices)}")
        return names
    return parse


def parse_args(argv):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--frameworks", type=name_list(FRAMEWORKS, "framework"), default=",".join(FRAMEWORKS),
                   help="comma-separated")
    p.add_argument("--mode", type=name_list(tuple(MODES), "mode"), default="scratch",
                   help="scratch (the recipe), builtin (the framework's own engine), "
                        "idiomatic (its minimal single-device loop, the timing reference)")
    p.add_argument("--exec", type=name_list(EXEC_LEVELS, "exec level"), default="default",
                   help="how the scratch step runs: default (the framework's usual way), eager, graph "
                        "(torch.compile, tf.function, hybridize, jax.jit), xla (tf.function+XLA)")
    p.add_argument("--layout", type=name_list(LAYOUTS, "layout"), default="default",
                   help="the scratch step's memory layout of images and conv kernels: default (the faster one "
                        "here: nhwc, MXNet's only nchw), nchw (channels first), nhwc (channels last)")
    p.add_argument("--devices", type=int_list, default="2", help="device counts, e.g. 1,2")
    p.add_argument("--processes", type=int_list, default="1",
                   help="process counts, e.g. 1,2: the devices are shared out among them")
    p.add_argument("--cores", type=name_list(CORES, "cores setting"), default="shared",
                   help="shared (every op may use all of --threads) or per-device (each device pinned to cores "
                        "of its own: --threads / the most devices; see common/cores.py); comma-separated")
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="the data set (see README)")
    p.add_argument("--data-dir", help="folder with the IDX files (fashion-mnist, mnist)")
    p.add_argument("--n-synthetic", type=int, default=60000, help="training images of the synthetic set")
    p.add_argument("--epochs", type=int, help="default 30 for digits, 10 otherwise")
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split across devices")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument("--init", choices=INITS, default="he", help="he, or the recipe's normal(0, 0.01)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads per run: all cores")
    p.add_argument("--repeats", type=int, default=1, help="trials per row, interleaved; medians are reported")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped")
    p.add_argument("--stall-timeout", type=float, default=300,
                   help="seconds without a new training step (the first one included) before a run is "
                        "stopped as stalled")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (after every finished row)")
    p.add_argument("--csv", metavar="PATH", help="write the table as CSV (after every finished row)")
    p.add_argument("--plot", metavar="PATH", help="write loss curves and throughput bars as a PNG")
    p.add_argument("--resume", action="store_true",
                   help="continue the run that --json holds: keep its ok rows (same settings and data "
                        "required), run the others")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save every run's trained model there, in its framework's native format, named "
                        "framework-mode-<devices>d-<processes>p-epoch<k> (.pt, .params, .weights.h5, .orbax)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="with --checkpoint-dir: also every N epochs")
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="start from a checkpoint saved after epoch k (its name says k) and train epochs k+1.. "
                        "--epochs in the batch order the uninterrupted run would see; one framework only")
    p.add_argument("--benchmark", action="store_true",
                   help="the timing benchmark: synthetic 30,000 images, batch 256, every exec mode, the "
                        "idiomatic references, both --cores settings, 3 trials; "
                        "writes results/benchmark.{md,csv,json,png}")
    p.add_argument("--list-devices", action="store_true", help="print the devices each framework sees; no training")
    p.add_argument("--merge", nargs="+", metavar="OUT_JSON",
                   help="no training: the table of hand-launched runs from their workers' out-{rank}.json files")
    args = p.parse_args(argv)
    args.plan = [(mode, tuple(args.exec), tuple(itertools.product(args.devices, args.processes)), cores,
                  tuple(args.layout)) for cores in args.cores for mode in args.mode]
    if args.benchmark:
        for key, value in BENCHMARK.items():
            setattr(args, key, value)
        args.devices = sorted({d for _, _, shapes, _, _ in args.plan for d, _ in shapes})
        for ext in ("json", "csv", "plot"):
            setattr(args, ext, getattr(args, ext) or os.path.join("results", f"benchmark.{'png' if ext == 'plot' else ext}"))
    if args.epochs is None:
        args.epochs = DEFAULT_EPOCHS.get(args.dataset, 10)
    for name in ("epochs", "batch_size", "threads", "n_synthetic", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "timeout", "stall_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.resume and (args.merge or args.list_devices or not args.json):
        p.error("--resume continues a training run: it needs the --json PATH of that run "
                "(not --merge or --list-devices)")
    if args.batch_size < max(args.devices):
        p.error(f"--batch-size {args.batch_size} is smaller than {max(args.devices)} devices")
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or not args.checkpoint_dir):
        p.error("--checkpoint-every needs --checkpoint-dir and N >= 1")
    for name in ("data_dir", "checkpoint_dir", "resume_from"):   # the workers run from the repo root
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


def list_devices(args):
    for name in args.frameworks:
        result = run_workers({"task": "devices", "framework": name, "devices": max(args.devices),
                              "threads": args.threads}, timeout=args.timeout)[0]
        if result["status"] != "ok":
            print(f"{name}: {result['status']}: {result['error']}")
            continue
        for d in result["devices"]:
            memory = f", {d['memory_bytes'] / 2**30:.1f} GiB" if d.get("memory_bytes") else ""
            print(f"{name}: [{d['index']}] {d['name']} ({d['type']}{memory})")
    return 0


def run_specs(args):
    """Every requested row as (spec, reason it cannot run or None)."""
    share = per_device_threads(args.threads, max(args.devices))   # each device's cores, per-device rows
    usable = len(os.sched_getaffinity(0))
    seen = {}
    for mode, levels, shapes, cores, layouts in args.plan:
        for level, layout in itertools.product(levels, layouts):
            for devices, processes in shapes:
                for name in args.frameworks:
                    world = devices if (name, mode) in PROCESS_PER_DEVICE else processes
                    threads = share * devices // world if cores == "per-device" else args.threads // world
                    spec = {"framework": name, "mode": mode, "exec": level, "devices": devices,
                            "processes": world, "cores": cores, "dataset": args.dataset, "data_dir": args.data_dir,
                            "n_synthetic": args.n_synthetic, "epochs": args.epochs,
                            "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                            "init": args.init, "threads": max(1, threads),
                            "checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
                            "resume_from": args.resume_from, "layout": layout}
                    key = json.dumps(spec, sort_keys=True)
                    skip = None
                    if devices % world:
                        skip = f"{devices} devices cannot be shared evenly among {world} processes"
                    elif mode != "scratch" and level != "default":
                        skip = f"exec levels apply to the scratch mode; {mode} runs its framework's own way"
                    elif mode != "scratch" and layout != "default":
                        skip = f"layouts apply to the scratch mode; {mode} runs in its framework's own layout"
                    elif mode == "idiomatic" and (devices, world) != (1, 1):
                        skip = "the idiomatic reference loop is single-device, single-process"
                    elif cores == "per-device" and (share < 1 or share * devices > usable):
                        skip = (f"a core per device: {max(args.devices)} devices need {max(args.devices)} of "
                                f"--threads {args.threads}, {usable} usable cores here")
                    elif key in seen:
                        skip = f"the same run as {seen[key]} ({name} {mode} runs one process per device)"
                    seen.setdefault(key, row_label(spec))
                    yield spec, skip


def progress_bar(label):
    """A one-line bar, redrawn in place, when stdout is a terminal; nothing in logs and pipes."""
    if not sys.stdout.isatty():
        return None

    def show(step, steps):
        done = int(30 * step / max(steps, 1))
        print(f"\r  {label} [{'#' * done}{'.' * (30 - done)}] {step}/{steps}", end="", flush=True)
    return show


def row_label(spec):
    layout = "" if spec.get("layout", "default") == "default" else f", {spec['layout']}"
    per_device = ", a core per device" if spec.get("cores") == "per-device" else ""
    return (f"{spec['framework']} {spec['mode']} ({spec['exec']}{layout}), {spec['devices']} device(s), "
            f"{spec['processes']} process(es){per_device}")


def run_one(spec, dataset, args, label):
    """One trial of one row: launch its processes and merge their records."""
    results = run_workers(spec, args.timeout, spec["processes"], progress=progress_bar(label),
                          stall_timeout=args.stall_timeout)
    if sys.stdout.isatty():
        print("\r\033[K", end="", flush=True)   # the bar's line, cleared for the table
    return merge_records(results, dataset["fingerprint"])


def merge_records(records, fingerprint):
    """A run's result from its processes' records: every process ok, on the same data, ending with the
    same weights (a run whose processes drifted apart computed something else)."""
    if any(r["status"] != "ok" for r in records):
        return next(r for r in records if r["status"] != "ok")
    if {r["fingerprint"] for r in records} != {fingerprint}:
        return {"status": "failed", "error": "a worker saw different data (fingerprint mismatch)"}
    if len({r["digest"] for r in records}) != 1:
        return {"status": "failed", "error": "the processes ended with different weights"}
    return {"status": "ok", "error": None, "fingerprint": fingerprint,
            "device_names": sum((r["device_names"] for r in records), []), **summarize(records)}


def settings(args):
    """This command's SETTINGS, as the JSON file stores them."""
    return json.loads(json.dumps({k: getattr(args, k) for k in SETTINGS}))


def output_paths(args):
    """Every file the command writes, by the option that asks for it."""
    paths = {"--json": args.json, "--csv": args.csv, "--plot": args.plot,
             "--benchmark": BENCHMARK_MD if args.benchmark else None}
    return {option: path for option, path in paths.items() if path}


def check_outputs(args):
    """Every output writable (and the plot's format one matplotlib writes) before the first row and
    before the data loads: a bad path costs seconds, not a finished run."""
    for option, path in output_paths(args).items():
        problem = unwritable(path)
        if problem:
            raise RosettaError(f"cannot write {option} {path}: {problem}")
    if args.plot:
        from common.plots import image_format
        image_format(args.plot)


def previous_run(args):
    """The file --resume continues, refused unless written with these settings (the data's fingerprint
    is checked once the data is loaded): rows of different runs are never mixed."""
    if not os.path.exists(args.json):
        print(f"--resume: {args.json} does not exist yet; running every row", file=sys.stderr)
        return None
    try:
        with open(args.json) as f:
            old = json.load(f)
    except (OSError, ValueError) as err:
        raise RosettaError(f"--resume: cannot read {args.json} ({err})")
    if not isinstance(old, dict) or not isinstance(old.get("settings"), dict):
        raise RosettaError(f"--resume: {args.json} was not written by compare.py --json (it holds no settings)")
    differ = [f"{k} {old['settings'].get(k)!r} there, {v!r} here" for k, v in settings(args).items()
              if old["settings"].get(k) != v]
    if differ:
        raise RosettaError(f"--resume: {args.json} holds a run with other settings ({'; '.join(differ)}); "
                           f"run without --resume to start afresh, or give another --json")
    return old


def kept_trials(old, label):
    """The trials of a row that the previous file holds as ok (a row keeps each trial's metrics)."""
    row = next((r for r in old["runs"] if r.get("row") == label and r["status"] == "ok"), None)
    return [{**row, **metrics} for metrics in row.get("trial_metrics", [{}])] if row else []


def check_data(args, dataset, old):
    """Enough training images for one batch (fewer trains rows of zero or one step and calls them ok),
    and, for --resume, the data the file's rows were computed on."""
    if dataset["n_train"] < args.batch_size:
        more = "raise --n-synthetic or " if args.dataset == "synthetic" else ""
        raise RosettaError(f"the {dataset['name']} training set has {dataset['n_train']} images, fewer than one "
                           f"batch of {args.batch_size}: {more}lower --batch-size")
    if old and old["dataset"].get("fingerprint") != dataset["fingerprint"]:
        raise RosettaError(f"--resume: {args.json} holds a run on other data (fingerprint "
                           f"{old['dataset'].get('fingerprint')} there, {dataset['fingerprint']} here); run without "
                           f"--resume to start afresh, or give another --json")


def compare(args):
    if args.resume_from:
        check_resume(args.resume_from, args.frameworks, args.epochs)
    old = previous_run(args) if args.resume else None
    dataset = load_dataset(args.dataset, args.data_dir, args.n_synthetic, args.seed).summary()   # fail early
    check_data(args, dataset, old)
    print(f"dataset {dataset['name']}: {dataset['n_train']} train / {dataset['n_test']} test images, "
          f"fingerprint {dataset['fingerprint']}", file=sys.stderr)
    specs = list(run_specs(args))
    labels = [row_label(spec) for spec, _ in specs]
    trials = [kept_trials(old, label) if old else [] for label in labels]
    wanted = [1 if skip else args.repeats for _, skip in specs]   # trials each row needs
    for label, row_trials in zip(labels, trials):
        if row_trials:
            print(f"kept {label}: ok ({len(row_trials)} trial(s) from {args.json})", file=sys.stderr)
    env = environment()
    if args.benchmark:   # this machine's yardsticks, measured in the run (common/calibration.py)
        print(f"calibration: float32 matmul peak at {args.threads} thread(s) ...", file=sys.stderr, flush=True)
        env["calibration"] = {"threads": args.threads, "matmul_peak_gflops_start": matmul_peak(args.threads)}
        load = LoadRecord().start()

    def save():
        return write_results(args, env, dataset, specs, labels, trials, wanted)
    runs = save()
    try:
        for trial in range(args.repeats):   # interleaved: machine drift hits every row alike
            for (spec, skip), label, row_trials, need in zip(specs, labels, trials, wanted):
                if trial >= need or len(row_trials) > trial:   # a skipped row runs once; a kept trial not again
                    continue
                shown = label + (f", trial {trial + 1}/{args.repeats}" if args.repeats > 1 else "")
                print(f"running {shown} ...", file=sys.stderr, flush=True)
                result = {"status": "skipped", "error": skip} if skip else run_one(spec, dataset, args, shown)
                print(f"  {result['status']}" + (f": {result['error']}" if result.get("error") else ""),
                      file=sys.stderr, flush=True)
                row_trials.append({"row": label, **{k: spec[k] for k in SPEC_FIELDS}, **result})
                runs = save()
    except KeyboardInterrupt as err:   # the running row's processes are gone already (run_workers)
        save()   # again: the signal may have cut the last save short (further signals are ignored now)
        done = sum(len(t) == w for t, w in zip(trials, wanted))
        files = " and ".join(filter(None, (args.json, args.csv)))
        trials_done = f" ({sum(map(len, trials))} of {sum(wanted)} trials)" if args.repeats > 1 else ""
        err.add_note(f"{done} of {len(specs)} rows finished{trials_done}" + (
            f", kept in {files}; the same command with --resume runs the rest" if files else ""))
        raise
    if args.benchmark:
        env["calibration"]["matmul_peak_gflops_end"] = matmul_peak(args.threads)
        env["load"] = load.stop()
        runs = save()
        if warning(env["load"]):
            print(warning(env["load"]), file=sys.stderr)
    return report(args, env, dataset, runs)


def write_results(args, env, dataset, specs, labels, trials, wanted):
    """Write the requested files as they stand (every row with a trial done, and which rows are still to
    run); return those rows. Called after every trial: an interrupted run leaves valid files."""
    rows = [aggregate(t) if t else {**{k: spec[k] for k in ROW_KEY}, "status": "not run", "error": None}
            for (spec, _), t in zip(specs, trials)]
    runs = [row for row, t in zip(rows, trials) if t]
    not_run = [label + (f" ({len(t)} of {w} trials done)" if t else "")
               for label, t, w in zip(labels, trials, wanted) if len(t) < w]
    add_scaling(runs)
    add_parity(runs)
    add_peak_fraction(runs, env.get("calibration"))
    write_files(args, {"environment": env, "settings": settings(args), "dataset": dataset,
                       "complete": not not_run, "not_run": not_run, "runs": runs}, rows)
    return runs


def write_files(args, content, rows):
    """The JSON file (`content`), the CSV (`rows`: a "not run" line for a row still to run) and the
    benchmark's markdown, each replaced atomically. The plot is drawn once, at the end (report); so is
    a stream (--json /dev/stdout), which cannot be replaced, only appended to."""
    final = not content.get("not_run")
    if args.json and (final or not is_stream(args.json)):
        write_json(args.json, content)
    if args.csv and (final or not is_stream(args.csv)):
        write_csv(args.csv, rows)
    if args.benchmark:
        env, runs = content["environment"], content["runs"]
        with replaced_atomically(BENCHMARK_MD) as f:
            f.write(f"Command: `python {env['command']}`\n\nEnvironment: {environment_line(env)}\n\n"
                    f"{format_table(runs, timing=True)}\n")
            if format_scaling(runs):
                f.write(f"\nScaling (cores shared: every op may use every thread; a core per device: each device "
                        f"pinned to cores of its own):\n\n{format_scaling(runs)}\n")
            if content.get("not_run"):
                f.write(f"\nIncomplete: not run yet: {'; '.join(content['not_run'])}\n")


def report(args, env, dataset, runs):
    """The table on stdout and the plot; exit status 1 if a run failed."""
    print(format_table(runs, timing=args.repeats > 1 or args.benchmark))
    if args.benchmark:
        print(f"\n{format_scaling(runs)}\n\n{environment_line(env)}")
    if args.plot:
        from common.plots import plot_runs
        plot_runs(args.plot, runs, title=f"{dataset['name']}, batch {runs[0]['batch_size']}, {env['cpu']}")
    for path in output_paths(args).values():
        print(f"wrote {path}", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in runs) else 0


def read_worker_records(paths):
    """The workers' records grouped by run (a run is its spec)."""
    runs = {}
    for path in paths:
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError) as err:
            raise RosettaError(f"{path}: cannot be read as a worker's JSON record ({err})")
        if not isinstance(record, dict) or "status" not in record:
            what = "compare.py's --json output, " if isinstance(record, dict) and "runs" in record else ""
            raise RosettaError(f"{path}: not a worker's record ({what}no status); --merge takes the "
                               "out-{rank}.json files that python -m common.worker writes")
        if record.get("status") != "ok":
            raise RosettaError(f"{path}: the worker {record.get('status')}: {record.get('error')}")
        if "spec" not in record:
            raise RosettaError(f"{path}: no run spec in the record (written by python -m common.worker?)")
        runs.setdefault(json.dumps(record["spec"], sort_keys=True), []).append(record)
    return list(runs.values())


def merge(args):
    """The table of hand-launched runs (torchrun, TF_CONFIG, DMLC_*): one row per run, its records
    checked as compare.py checks its own (every rank once, the same data, the same final weights)."""
    runs, datasets = [], {}   # datasets: (name, data_dir, size, seed) -> summary of the local copy
    for records in read_worker_records(args.merge):
        spec, world = records[0]["spec"], records[0]["world"]
        ranks = sorted(r["rank"] for r in records)
        if ranks != list(range(world)):
            raise RosettaError(f"{spec['framework']} {spec['mode']} run of {world} processes: found rank(s) "
                               f"{', '.join(map(str, ranks))}; give one file per rank")
        source = (spec["dataset"], spec.get("data_dir"), spec.get("n_synthetic", 60000), spec["seed"])
        if source not in datasets:
            datasets[source] = load_dataset(*source).summary()
        row = {"exec": "default", "layout": "default", "cores": "shared", "init": "he", "threads": None, **spec,
               "processes": world}
        runs.append(aggregate([{**{k: row[k] for k in SPEC_FIELDS},
                                **merge_records(records, datasets[source]["fingerprint"])}]))
    summaries = {d["fingerprint"]: d for d in datasets.values()}
    if len(summaries) != 1:
        raise RosettaError(f"the runs used {len(summaries) or 'no'} different data sets; merge the runs of "
                           "one data set at a time")
    dataset, env = next(iter(summaries.values())), environment()
    add_scaling(runs)
    add_parity(runs)
    write_files(args, {"environment": env, "dataset": dataset, "runs": runs}, runs)
    return report(args, env, dataset, runs)


def main(argv=None):
    raise_on_signals()   # SIGTERM and SIGHUP end a run the way Ctrl-C does
    args = parse_args(argv)
    try:
        check_outputs(args)
        if args.list_devices:
            return list_devices(args)
        return merge(args) if args.merge else compare(args)
    except RosettaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:   # Ctrl-C, SIGTERM, SIGHUP (common.launch.Interrupted)
        signum = getattr(err, "signum", signal.SIGINT)
        say("; ".join([f"\ninterrupted by {signal.Signals(signum).name}", *getattr(err, "__notes__", [])]))
        return 128 + signum   # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP


def say(text):
    """A last word on stderr, which may be gone (a closed terminal is what sent SIGHUP): then what is
    left to print goes nowhere, rather than fail the exit."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())


if __name__ == "__main__":
    sys.exit(main())
