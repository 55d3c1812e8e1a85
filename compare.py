"""Train the same LeNet, data-parallel, in every framework on identical data and compare.

    python compare.py                          # all frameworks, digits, 2 devices
    python compare.py --dataset fashion-mnist  # the recipe's data set (see docs/usage.md)
    python compare.py --mode scratch,builtin --processes 1,2   # the frameworks' own engines too
    python compare.py --benchmark              # the timing table: table, CSV, JSON and PNG
    python compare.py --list-devices           # what each framework sees
    python compare.py --merge out-*.json       # the table of a hand-launched run (torchrun, TF_CONFIG, DMLC_*)

Read top to bottom: parse the options, plan the rows (harness/run/plan.py), run each in its own worker processes
(harness/run/worker.py: thread counts fixed before the framework is imported, a framework that crashes or is
missing costs only its own row), report. The requested files are rewritten after every finished trial, so an
interrupted run keeps its finished rows (--resume goes on).
"""
import os
import signal
import sys
import time

from common.data import load_dataset
from common.interface import RosettaError
from harness.studies.benchmark import add_scaling
from harness.studies.calibration import LoadRecord, machine_lockstep, matmul_peak, warning
from harness.training.checkpoints import check_resume, epoch_of, latest_checkpoint
from harness.processes.launch import raise_on_signals, run_workers
from harness.run.merge import merge_files, merge_records
from harness.run.options import parse_args as parse_options
from harness.run.outputs import check_outputs, output_paths, write_files, write_results
from harness.run.plan import check_data, row_label, run_specs
from harness.training.profile import trace_folder
from harness.publishing.provenance import environment, environment_line
from harness.publishing.tables import add_parity, format_scaling, format_split, format_table, optimizer_line, progress_bar, \
    timing_view
from harness.run.resume import check_same_data, kept_trials, previous_run
from harness.studies.split import allreduce_alone, alongside


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
    """Every planned row, trial by trial (interleaved: machine drift hits every row alike); the files after each."""
    if args.resume_from:
        check_resume(args.resume_from, args.frameworks, args.epochs)
    old = previous_run(args) if args.resume else None
    dataset = load_dataset(args.dataset, args.data_dir, args.n_synthetic, args.seed).summary()   # fail early
    check_data(args, dataset)
    check_same_data(old, dataset, args.json)
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
    timing = timing_view(vars(args))   # the benchmark, or repeated trials: speed is what the run is for
    if timing:   # this machine's yardsticks, measured in the run (harness/studies/calibration.py)
        print(f"calibration: float32 matmul peak at {args.threads} thread(s) ...", file=sys.stderr, flush=True)
        env["calibration"] = {"threads": args.threads, "matmul_peak_gflops_start": matmul_peak(args.threads)}
        cores = sorted(os.sched_getaffinity(0))[:max((spec.processes for spec, skip in specs if not skip), default=1)]
        if len(cores) > 1 and args.cluster.nnodes == 1:   # what waiting for the slower step costs with no framework
            print(f"calibration: numpy steps in lockstep, a process on each of cores {cores} ...", file=sys.stderr,
                  flush=True)
            env["calibration"]["lockstep"] = machine_lockstep(cores)
        load = LoadRecord().start()

    def save():
        return write_results(args, env, dataset, specs, labels, trials, wanted)
    runs = save()
    try:
        for trial in range(args.repeats):
            for (spec, skip), label, row_trials, need in zip(specs, labels, trials, wanted):
                if trial >= need or len(row_trials) > trial:   # a skipped row runs once; a kept trial not again
                    continue
                shown = label + (f", trial {trial + 1}/{args.repeats}" if args.repeats > 1 else "")
                print(f"running {shown} ...", file=sys.stderr, flush=True)
                result = {"status": "skipped", "error": skip} if skip else run_one(spec, dataset, args, shown)
                row_trials.append({"row": label, **spec.row(), **result})
                runs = save()   # the trial is kept before the measurements that split its step
                if timing and spec.devices > 1 and result["status"] == "ok":   # the step's all-reduce alone
                    print("  its all-reduce alone ...", file=sys.stderr, flush=True)
                    row_trials[-1].update(allreduce_alone(spec, args.timeout, args.cluster))
                    if spec.processes > 1:   # and its processes alongside each other, with nothing to share
                        print("  its processes alongside ...", file=sys.stderr, flush=True)
                        row_trials[-1].update(alongside(spec, args.timeout, args.cluster, dataset["n_train"]))
                    runs = save()
                print(f"  {result['status']}" + (f": {result['error']}" if result.get("error") else ""),
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt as err:   # the running row's processes are gone already (run_workers)
        save()   # again: the signal may have cut the last save short (further signals are ignored now)
        done = sum(len(t) == w for t, w in zip(trials, wanted))
        files = " and ".join(filter(None, (args.json, args.csv)))
        trials_done = f" ({sum(map(len, trials))} of {sum(wanted)} trials)" if args.repeats > 1 else ""
        err.add_note(f"{done} of {len(specs)} rows finished{trials_done}" + (
            f", kept in {files}; the same command with --resume runs the rest" if files else ""))
        raise
    if timing:
        env["calibration"]["matmul_peak_gflops_end"] = matmul_peak(args.threads)
        env["load"] = load.stop()
        runs = save()
        if warning(env["load"]):
            print(warning(env["load"]), file=sys.stderr)
    return report(args, env, dataset, runs)


def run_one(spec, dataset, args, label):
    """One trial of one row: launch its processes (this host's, with --hosts) and merge their records. With
    --max-restarts, a run whose process died is stopped whole and started again from its last complete checkpoint,
    as torchrun restarts a group: the row counts the restarts and the time they cost."""
    if args.profile:
        spec = spec.replace(profile=trace_folder(args.profile, spec))
    started, restarts, attempt = time.monotonic(), 0, spec
    while True:
        attempt_started = time.monotonic()
        results = run_workers(attempt, args.timeout, progress=progress_bar(label), stall_timeout=args.stall_timeout,
                              cluster=args.cluster)
        if sys.stdout.isatty():
            print("\r\033[K", end="", flush=True)   # the bar's line, cleared for the table
        result = merge_records(results, dataset["fingerprint"])
        if result["status"] != "failed" or restarts == args.max_restarts:
            break
        restarts += 1
        attempt = spec.replace(resume_from=latest_checkpoint(spec, say))
        print(f"  failed: {result['error']}\n  restart {restarts} of {args.max_restarts}, from "
              f"{os.path.basename(attempt.resume_from) if attempt.resume_from else 'the start'}", file=sys.stderr)
    if args.max_restarts:
        result["restarts"] = restarts
        if result["status"] == "ok":   # the wall time beyond what the last attempt and the epochs it skipped took
            skipped = result["first_epoch"] - (epoch_of(spec.resume_from) if spec.resume_from else 0)
            result["lost_seconds"] = max(0.0, attempt_started - started - skipped * result["epoch_seconds_median"])
    if args.cluster.nnodes > 1 and result["status"] == "ok":   # see host_sums
        result.update(hosts=list(args.cluster.hosts), node_rank=args.cluster.node_rank, **host_sums(results))
    return result


def host_sums(records):
    """A host sees its own processes' records only, so its row's losses are over its share of every batch. Its
    row keeps their sums, so that the run's losses are all hosts' sums added up (the final weights, test
    accuracy and digest are the run's on every host)."""
    return {key: [float(sum(values)) for values in zip(*(r[key] for r in records))]
            for key in ("epoch_loss_sums", "epoch_sizes", "step_loss_sums", "step_sizes")}


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
    if format_split(runs):
        print(f"\nWhere each step of several devices goes (harness/studies/split.py):\n{format_split(runs)}")
    if args.plot:
        from harness.publishing.plots import plot_runs
        plot_runs(args.plot, runs, title=f"{dataset['name']}, batch {runs[0]['batch_size']}, {env['cpu']}")
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
