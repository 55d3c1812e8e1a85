"""Train the same LeNet, data-parallel, in every framework on identical data and compare.

    python compare.py                          # all frameworks, digits, 2 devices
    python compare.py --dataset fashion-mnist  # the recipe's data set (see README)
    python compare.py --mode scratch,builtin --processes 1,2   # the frameworks' own engines too
    python compare.py --benchmark              # the timing table: table, CSV, JSON and PNG
    python compare.py --list-devices           # what each framework sees
    python compare.py --merge out-*.json       # the table of a hand-launched run (torchrun, TF_CONFIG, DMLC_*)

Each run happens in its own process (common/worker.py): thread counts are fixed before the framework
is imported, and a framework that crashes or is missing costs only its own row.
"""
import argparse
import json
import os
import sys

from common.benchmark import add_scaling, aggregate, write_csv
from common.checkpoints import check_resume
from common.data import DATASETS, load_dataset
from common.interface import FRAMEWORKS, RosettaError
from common.launch import PROCESS_PER_DEVICE, run_workers
from common.lenet import INITS
from common.report import add_parity, environment, environment_line, format_table, write_json
from common.training import MODES, summarize

DEFAULT_EPOCHS = {"digits": 30}   # small data: few steps per epoch; the recipe's 10 elsewhere
EXEC_LEVELS = ("default", "eager", "graph", "xla")
# --benchmark: the setting (synthetic 60,000 images, batch 256), every execution mode on one
# device, the idiomatic reference loops, the default mode on 2 devices for scaling, and the built-in engines
# on 2 devices, fed by their frameworks' own input pipelines; 3 trials.
BENCHMARK = {"dataset": "synthetic", "n_synthetic": 60000, "epochs": 1, "batch_size": 256, "repeats": 3,
             "plan": [("scratch", ("eager", "graph", "xla"), 1), ("idiomatic", ("default",), 1),
                      ("scratch", ("default",), 2), ("builtin", ("default",), 2)]}
SPEC_FIELDS = ("framework", "mode", "exec", "devices", "processes", "epochs", "batch_size", "lr", "seed",
               "init", "threads")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, not the whole usage block: the problem and where to look."""
        self.exit(2, f"error: {message} (see python compare.py --help)\n")


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
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", type=name_list(FRAMEWORKS, "framework"), default=list(FRAMEWORKS),
                   help="comma-separated, default all: " + ",".join(FRAMEWORKS))
    p.add_argument("--mode", type=name_list(tuple(MODES), "mode"), default=["scratch"],
                   help="scratch (the recipe, default), builtin (the framework's own engine), "
                        "idiomatic (its minimal single-device loop, the timing reference)")
    p.add_argument("--exec", type=name_list(EXEC_LEVELS, "exec level"), default=["default"],
                   help="how the scratch step runs: default (the framework's usual way), eager, graph "
                        "(torch.compile, tf.function, hybridize, jax.jit), xla (tf.function+XLA)")
    p.add_argument("--devices", type=int_list, default=[2], help="device counts, e.g. 1,2 (default 2)")
    p.add_argument("--processes", type=int_list, default=[1],
                   help="process counts, e.g. 1,2 (default 1): the devices are shared out among them")
    p.add_argument("--dataset", choices=DATASETS, default="digits")
    p.add_argument("--data-dir", help="folder with the IDX files (fashion-mnist, mnist)")
    p.add_argument("--n-synthetic", type=int, default=60000, help="training images of the synthetic set")
    p.add_argument("--epochs", type=int, help="default 30 for digits, 10 otherwise")
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split across devices")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument("--init", choices=INITS, default="he", help="he (default) or the recipe's normal(0, 0.01)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads per run (default: all cores)")
    p.add_argument("--repeats", type=int, default=1, help="trials per row, interleaved; medians are reported")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--csv", metavar="PATH", help="write the table as CSV")
    p.add_argument("--plot", metavar="PATH", help="write loss curves and throughput bars as a PNG")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save every run's trained model there, in its framework's native format, named "
                        "framework-mode-<devices>d-<processes>p-epoch<k> (.pt, .params, .weights.h5, .orbax)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="with --checkpoint-dir: also every N epochs")
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="start from a checkpoint saved after epoch k (its name says k) and train epochs k+1.. "
                        "--epochs in the batch order the uninterrupted run would see; one framework only")
    p.add_argument("--benchmark", action="store_true",
                   help="the timing benchmark: synthetic 60,000 images, batch 256, every exec mode, the "
                        "idiomatic references, 3 trials; writes results/benchmark.{md,csv,json,png}")
    p.add_argument("--list-devices", action="store_true", help="print the devices each framework sees; no training")
    p.add_argument("--merge", nargs="+", metavar="OUT_JSON",
                   help="no training: the table of hand-launched runs from their workers' out-{rank}.json files")
    args = p.parse_args(argv)
    args.plan = [(mode, tuple(args.exec), None) for mode in args.mode]
    if args.benchmark:
        for key, value in BENCHMARK.items():
            setattr(args, key, value)
        args.devices = sorted({d for _, _, d in args.plan})
        for ext in ("json", "csv", "plot"):
            setattr(args, ext, getattr(args, ext) or os.path.join("results", f"benchmark.{'png' if ext == 'plot' else ext}"))
    if args.epochs is None:
        args.epochs = DEFAULT_EPOCHS.get(args.dataset, 10)
    for name in ("epochs", "batch_size", "threads", "n_synthetic", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        p.error("--lr must be > 0")
    if args.batch_size < max(args.devices):
        p.error(f"--batch-size {args.batch_size} is smaller than {max(args.devices)} devices")
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or not args.checkpoint_dir):
        p.error("--checkpoint-every needs --checkpoint-dir and N >= 1")
    for name in ("checkpoint_dir", "resume_from"):   # the workers run from the repo root
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
    for mode, levels, only_devices in args.plan:
        for level in levels:
            for devices in ([only_devices] if only_devices else args.devices):
                for processes in args.processes:
                    for name in args.frameworks:
                        world = devices if (name, mode) in PROCESS_PER_DEVICE else processes
                        spec = {"framework": name, "mode": mode, "exec": level, "devices": devices,
                                "processes": world, "dataset": args.dataset, "data_dir": args.data_dir,
                                "n_synthetic": args.n_synthetic, "epochs": args.epochs,
                                "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                                "init": args.init, "threads": max(1, args.threads // world),
                                "checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
                                "resume_from": args.resume_from}
                        skip = None
                        if devices % world:
                            skip = f"{devices} devices cannot be shared evenly among {world} processes"
                        elif mode != "scratch" and level != "default":
                            skip = f"exec levels apply to the scratch mode; {mode} runs its framework's own way"
                        elif mode == "idiomatic" and (devices, world) != (1, 1):
                            skip = "the idiomatic reference loop is single-device, single-process"
                        yield spec, skip


def progress_bar(label):
    """A one-line bar, redrawn in place, when stdout is a terminal; nothing in logs and pipes."""
    if not sys.stdout.isatty():
        return None

    def show(step, steps):
        done = int(30 * step / max(steps, 1))
        print(f"\r  {label} [{'#' * done}{'.' * (30 - done)}] {step}/{steps}", end="", flush=True)
    return show


def run_one(spec, dataset, timeout, label):
    """One trial of one row: launch its processes and merge their records."""
    results = run_workers(spec, timeout, spec["processes"], progress=progress_bar(label))
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


def compare(args):
    if args.resume_from:
        check_resume(args.resume_from, args.frameworks, args.epochs)
    data = load_dataset(args.dataset, args.data_dir, args.n_synthetic, args.seed)   # fail early on bad data
    dataset = data.summary()
    print(f"dataset {dataset['name']}: {dataset['n_train']} train / {dataset['n_test']} test images, "
          f"fingerprint {dataset['fingerprint']}", file=sys.stderr)
    specs = list(run_specs(args))
    trials = [[] for _ in specs]
    for trial in range(args.repeats):   # interleaved: machine drift hits every row alike
        for (spec, skip), row_trials in zip(specs, trials):
            label = (f"{spec['framework']} {spec['mode']} ({spec['exec']}), {spec['devices']} device(s), "
                     f"{spec['processes']} process(es)" + (f", trial {trial + 1}/{args.repeats}" if args.repeats > 1 else ""))
            if skip and trial:
                continue
            print(f"running {label} ...", file=sys.stderr, flush=True)
            result = {"status": "skipped", "error": skip} if skip else run_one(spec, dataset, args.timeout, label)
            print(f"  {result['status']}" + (f": {result['error']}" if result.get("error") else ""),
                  file=sys.stderr, flush=True)
            row_trials.append({**{k: spec[k] for k in SPEC_FIELDS}, **result})
    return report(args, [aggregate(t) for t in trials], dataset)


def report(args, runs, dataset):
    """The table on stdout and the requested files; exit status 1 if a run failed."""
    add_scaling(runs)
    add_parity(runs)
    table = format_table(runs, timing=args.repeats > 1 or args.benchmark)
    print(table)
    env = environment()
    if args.json:
        write_json(args.json, env, dataset, runs)
    if args.csv:
        write_csv(args.csv, runs)
    if args.plot:
        from common.plots import plot_runs
        plot_runs(args.plot, runs, title=f"{dataset['name']}, batch {runs[0]['batch_size']}, {env['cpu']}")
    if args.benchmark:
        with open(os.path.join("results", "benchmark.md"), "w") as f:
            f.write(f"Command: `python {env['command']}`\n\nEnvironment: {environment_line(env)}\n\n{table}\n")
    for path in filter(None, (args.json, args.csv, args.plot)):
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
        row = {"exec": "default", "init": "he", "threads": None, **spec, "processes": world}
        runs.append(aggregate([{**{k: row[k] for k in SPEC_FIELDS},
                                **merge_records(records, datasets[source]["fingerprint"])}]))
    summaries = {d["fingerprint"]: d for d in datasets.values()}
    if len(summaries) != 1:
        raise RosettaError(f"the runs used {len(summaries) or 'no'} different data sets; merge the runs of "
                           "one data set at a time")
    return report(args, runs, next(iter(summaries.values())))


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.list_devices:
            return list_devices(args)
        return merge(args) if args.merge else compare(args)
    except RosettaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
