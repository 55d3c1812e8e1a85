"""Train the same LeNet, data-parallel, in every framework on identical data and compare.

    python compare.py                          # all frameworks, digits, 2 devices
    python compare.py --dataset fashion-mnist  # the recipe's data set (see docs/usage.md)
    python compare.py --mode scratch,builtin --processes 1,2   # the frameworks' own engines too
    python compare.py --benchmark              # the timing table: table, CSV, JSON and PNG
    python compare.py --list-devices           # what each framework sees
    python compare.py --merge out-*.json       # the table of a hand-launched run (torchrun, TF_CONFIG, DMLC_*)

Read top to bottom: parse the options (harness/run/options.py), plan the rows (harness/run/plan.py), run their
trials, each in its own worker processes (harness/run/trials.py, harness/run/worker.py: thread counts fixed before
the framework is imported, a framework that crashes or is missing costs only its own row), write the files, print
the table. The requested files are rewritten after every finished trial, so an interrupted run keeps its finished
rows (--resume goes on).
"""
import signal
import sys

from common.data import load_dataset
from common.interface import RosettaError
from harness.processes.launch import raise_on_signals, run_workers, say
from harness.publishing.provenance import environment, environment_line
from harness.publishing.tables import add_parity, format_precision, format_scaling, format_split, format_table, \
    optimizer_line, timing_view
from harness.run.merge import merge_files
from harness.run.options import parse_args as parse_options
from harness.run.outputs import check_outputs, output_paths, write_files
from harness.run.plan import check_data, run_specs
from harness.run.resume import check_same_data, previous_run
from harness.run.trials import all_done, planned_trials, run_trials
from harness.studies.benchmark import add_scaling
from harness.training.checkpoints import check_resume


def parse_args(argv):
    """The options (harness/run/options.py: every one, grouped, each checked where it is parsed)."""
    return parse_options(argv, __doc__.split("\n\n")[0])


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


def compare(args):
    """Every planned row, trial by trial (harness/run/trials.py); the files after each; the table."""
    if args.resume_from:
        check_resume(args.resume_from, args.frameworks, args.epochs)
    old = previous_run(args) if args.resume else None
    dataset = load_dataset(args.dataset, args.data_dir, args.n_synthetic, args.seed).summary()   # fail early
    check_data(args, dataset)
    check_same_data(old, dataset, args.json)
    print(f"dataset {dataset['name']}: {dataset['n_train']} train / {dataset['n_test']} test images, "
          f"fingerprint {dataset['fingerprint']}", file=sys.stderr)
    specs = list(run_specs(args))
    labels, trials, wanted = planned_trials(args, specs, old)
    env = old["environment"] if old and all_done(trials, wanted) else environment()   # a finished run keeps its own
    runs = run_trials(args, env, dataset, specs, labels, trials, wanted)
    return report(args, env, dataset, runs)


def merge(args):
    """The table of hand-launched runs (torchrun, TF_CONFIG, DMLC_*, JAX_*): one row per run (harness/run/merge.py)."""
    dataset, runs = merge_files(args.merge)
    env = environment()
    add_scaling(runs)
    add_parity(runs)
    write_files(args, {"environment": env, "dataset": dataset, "runs": runs}, runs)
    return report(args, env, dataset, runs)


def report(args, env, dataset, runs):
    """The table on stdout and the plot; exit status 1 if a run failed."""
    if getattr(args, "optimizer", None) and optimizer_line(args):
        print(optimizer_line(args))
    print(format_table(runs, timing=timing_view(vars(args))))
    if args.cluster.nnodes > 1:
        print(f"(host {args.cluster.node_rank} of {args.cluster.nnodes}: the losses are over this host's processes; "
              "the weights and the accuracy are the run's)")
    if args.benchmark:
        print(f"\n{format_scaling(runs)}\n\n{environment_line(env)}")
    precision = format_precision(runs)
    if precision:
        print(f"\nWhat the low precision buys, against the fp32 row of the same run:\n{precision}")
    if format_split(runs):
        print(f"\nWhere each step of several devices goes (harness/studies/split.py):\n{format_split(runs)}")
    if args.plot:
        from harness.publishing.plots import plot_runs
        batches = ", ".join(map(str, sorted({r.get("batch_size") for r in runs} - {None})))   # --per-device-batch: several
        plot_runs(args.plot, runs, title=f"{dataset['name']}, batch {batches}, {env['cpu']}")
    for path in output_paths(args).values():
        print(f"wrote {path}", file=sys.stderr)
    for r in runs:
        if r.get("profile"):
            print(f"trace of {r['framework']} {r['mode']} {r['devices']}d/{r['processes']}p: {r['profile']}",
                  file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in runs) else 0


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
    except KeyboardInterrupt as err:   # Ctrl-C, SIGTERM, SIGHUP (harness.processes.launch.Interrupted)
        signum = getattr(err, "signum", signal.SIGINT)
        say("; ".join([f"\ninterrupted by {signal.Signals(signum).name}", *getattr(err, "__notes__", [])]))
        return 128 + signum   # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP


if __name__ == "__main__":
    sys.exit(main())
