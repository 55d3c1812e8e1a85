"""Train the same LeNet, data-parallel, in every framework on identical data and compare.

    python compare.py                          # all frameworks, digits, 2 devices
    python compare.py --dataset fashion-mnist  # the recipe's data set (see README)
    python compare.py --list-devices           # what each framework sees

Each run happens in its own process (common/worker.py): thread counts are fixed before the framework
is imported, and a framework that crashes or is missing costs only its own row.
"""
import argparse
import os
import sys

from common.data import DATASETS, load_dataset
from common.interface import FRAMEWORKS, RosettaError, check_name
from common.lenet import INITS
from common.launch import run_workers
from common.report import add_parity, environment, format_table, write_json
from common.training import MODES, summarize

DEFAULT_EPOCHS = {"digits": 30}   # small data: few steps per epoch; the recipe's 10 elsewhere
# DistributedDataParallel is PyTorch's only working data parallelism on the CPU: one process per device.
PROCESS_PER_DEVICE = {("pytorch", "builtin")}


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


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, not the whole usage block: the problem and where to look."""
        self.exit(2, f"error: {message} (see python compare.py --help)\n")


def parse_args(argv):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", type=name_list(FRAMEWORKS, "framework"), default=list(FRAMEWORKS),
                   help="comma-separated, default all: " + ",".join(FRAMEWORKS))
    p.add_argument("--mode", type=name_list(tuple(MODES), "mode"), default=["scratch"],
                   help="scratch (the recipe, default) and/or builtin (the framework's own engine)")
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
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--list-devices", action="store_true", help="print the devices each framework sees; no training")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = DEFAULT_EPOCHS.get(args.dataset, 10)
    for name in ("epochs", "batch_size", "threads", "n_synthetic"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        p.error("--lr must be > 0")
    if args.batch_size < max(args.devices):
        p.error(f"--batch-size {args.batch_size} is smaller than {max(args.devices)} devices")
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
    """Every requested (mode, devices, processes, framework), or the reason it cannot run."""
    for mode in args.mode:
        for devices in args.devices:
            for processes in args.processes:
                for name in args.frameworks:
                    world = devices if (name, mode) in PROCESS_PER_DEVICE else processes
                    spec = {"framework": name, "mode": mode, "devices": devices, "processes": world,
                            "dataset": args.dataset, "data_dir": args.data_dir, "n_synthetic": args.n_synthetic,
                            "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
                            "seed": args.seed, "init": args.init, "threads": max(1, args.threads // world)}
                    skip = None
                    if devices % world:
                        skip = f"{devices} devices cannot be shared evenly among {world} processes"
                    yield spec, skip


def run_one(spec, dataset, timeout):
    """One row: launch the run's processes, merge their records, check they saw the same data."""
    results = run_workers(spec, timeout, spec["processes"])
    if any(r["status"] != "ok" for r in results):
        return next(r for r in results if r["status"] != "ok")
    if {r["fingerprint"] for r in results} != {dataset["fingerprint"]}:
        return {"status": "failed", "error": "a worker saw different data (fingerprint mismatch)"}
    return {"status": "ok", "error": None, "fingerprint": dataset["fingerprint"],
            "device_names": sum((r["device_names"] for r in results), []), **summarize(results)}


def compare(args):
    data = load_dataset(args.dataset, args.data_dir, args.n_synthetic, args.seed)   # fail early on bad data
    dataset = data.summary()
    print(f"dataset {dataset['name']}: {dataset['n_train']} train / {dataset['n_test']} test images, "
          f"fingerprint {dataset['fingerprint']}", file=sys.stderr)
    runs = []
    for spec, skip in run_specs(args):
        label = f"{spec['framework']} {spec['mode']}, {spec['devices']} device(s), {spec['processes']} process(es)"
        print(f"running {label} ...", file=sys.stderr, flush=True)
        result = {"status": "skipped", "error": skip} if skip else run_one(spec, dataset, args.timeout)
        print(f"  {result['status']}" + (f": {result['error']}" if result.get("error") else ""),
              file=sys.stderr, flush=True)
        runs.append({**{k: spec[k] for k in ("framework", "mode", "devices", "processes", "epochs",
                                             "batch_size", "lr", "seed", "init", "threads")}, **result})
    add_parity(runs)
    print(format_table(runs))
    if args.json:
        write_json(args.json, environment(), dataset, runs)
        print(f"results written to {args.json}", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in runs) else 0


def main(argv=None):
    args = parse_args(argv)
    try:
        return list_devices(args) if args.list_devices else compare(args)
    except RosettaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
