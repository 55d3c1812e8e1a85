"""The trials of a command's rows: each planned row run --repeats times, interleaved (machine drift hits every row
alike), the requested files rewritten after every trial so that an interrupted run keeps its finished ones. In the
timing view the machine's yardsticks are measured around the trials, and each step of several devices is split into
its parts. A trial launches the row's processes and merges their records; one whose process died starts again from
its last checkpoint (--max-restarts)."""
import os
import subprocess
import sys
import time

from common.interface import RosettaError
from common.precision import PRECISIONS, is_low

from ..loader import installed_version
from ..processes.launch import run_workers, say
from ..publishing.tables import one_line, progress_bar, timing_view
from ..studies.calibration import LoadRecord, low_matmul_peaks, machine_lockstep, matmul_peak, warning
from ..studies.split import allreduce_alone, alongside
from ..training.checkpoints import latest_checkpoint
from ..training.profile import short_rows, trace_folder
from .merge import merge_records
from .outputs import write_results
from .plan import row_label
from .resume import kept_trials


def planned_trials(args, specs, old):
    """(each row's label, its trials so far: those kept from the run --resume continues, the trials it needs)."""
    labels = [row_label(spec) for spec, _ in specs]
    trials = [kept_trials(old, label) if old else [] for label in labels]
    wanted = [1 if skip else args.repeats for _, skip in specs]   # a skipped row runs once
    for label, row_trials in zip(labels, trials):
        if row_trials:
            print(f"kept {label}: ok ({len(row_trials)} trial(s) from {args.json})", file=sys.stderr)
    return labels, trials, wanted


def all_done(trials, wanted):
    """Whether every row has the trials it needs: a finished run, resumed."""
    return all(len(row_trials) >= need for row_trials, need in zip(trials, wanted))


def profile_note(args, dataset, specs, labels, trials, wanted):
    """With --profile, the line said before the first row naming the rows to run that are too short for its window
    (training/profile.short_rows), or None."""
    if not getattr(args, "profile", None):
        return None
    return short_rows([(label, spec) for (spec, skip), label, t, w in zip(specs, labels, trials, wanted)
                       if not skip and len(t) < w], dataset["n_train"])


def run_trials(args, env, dataset, specs, labels, trials, wanted):
    """Every row's missing trials, trial by trial, the files written after each; the rows as last written."""
    if all_done(trials, wanted):   # a finished run resumed: nothing measured, its environment kept
        return write_results(args, env, dataset, specs, labels, trials, wanted)
    note = profile_note(args, dataset, specs, labels, trials, wanted)
    if note:
        print(note, file=sys.stderr, flush=True)
    timing = timing_view(vars(args))   # the benchmark, or repeated trials: speed is what the run is for
    if timing:
        calibrate(args, env, specs)
    load = LoadRecord().start()   # every run's speeds are printed: a busy machine's are not to be read as such

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
                result = ({"status": "skipped", "error": skip} if skip
                          else run_trial(spec, dataset, args, shown, trial))
                row_trials.append({"row": label, **spec.row(), **result})
                runs = save()   # the trial is kept before the measurements that split its step
                if timing and spec.devices > 1 and result["status"] == "ok":
                    split_step(row_trials[-1], spec, args, dataset)
                    runs = save()
                print(f"  {result['status']}" + (f": {one_line(result['error'])}" if result.get("error") else ""),
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt as err:   # the running row's processes are gone already (run_workers)
        save()   # again: the signal may have cut the last save short (further signals are ignored now)
        err.add_note(unfinished(args, specs, trials, wanted))
        raise
    if timing:
        env["calibration"]["matmul_peak_gflops_end"] = matmul_peak(args.threads)
    env["load"] = load.stop()
    runs = save()
    if warning(env["load"]):
        print(warning(env["load"]), file=sys.stderr)
    return runs


def calibrate(args, env, specs):
    """This machine's yardsticks, measured before the first trial (harness/studies/calibration.py): its matmul peak
    and, for rows of several processes, what lockstep costs with no framework."""
    print(f"calibration: float32 matmul peak at {args.threads} thread(s) ...", file=sys.stderr, flush=True)
    env["calibration"] = {"threads": args.threads, "matmul_peak_gflops_start": matmul_peak(args.threads)}
    lows = tuple(precision for precision in PRECISIONS if is_low(precision) and precision in args.precision)
    if lows or installed_version("pytorch"):   # numpy's BLAS may not know the CPU: PyTorch's fp32 peak beside it
        names = ("fp32", *lows)   # the run's own precisions: fp16's is slow to measure where the CPU has no kernel
        print(f"calibration: {', '.join(names)} matmul peak{'s' if lows else ''} (PyTorch) at {args.threads} "
              f"thread(s) ...", file=sys.stderr, flush=True)
        try:
            env["calibration"]["low_matmul_peaks_gflops"] = low_matmul_peaks(args.threads, names)
        except (subprocess.SubprocessError, ValueError) as err:   # a broken PyTorch: fp32 rows keep numpy's yardstick
            if lows:
                hint = "it took too long" if isinstance(err, subprocess.TimeoutExpired) else "check that `import torch` works"
                raise RosettaError(f"PyTorch's {' and '.join(lows)} matmul peak{'s' if len(lows) > 1 else ''}, the "
                                   f"yardstick of --precision's rows, could not be measured ({type(err).__name__}: "
                                   f"{hint})") from err
            print(f"note: PyTorch's fp32 matmul peak could not be measured ({type(err).__name__}); the rows' "
                  f"fractions of peak are of numpy's", file=sys.stderr, flush=True)
    cores = sorted(os.sched_getaffinity(0))[:max((spec.processes for spec, skip in specs if not skip), default=1)]
    if len(cores) > 1 and args.cluster.nnodes == 1:   # what waiting for the slower step costs with no framework
        print(f"calibration: numpy steps in lockstep, a process on each of cores {cores} ...", file=sys.stderr,
              flush=True)
        env["calibration"]["lockstep"] = machine_lockstep(cores)


def split_step(trial, spec, args, dataset):
    """What splits an ok trial's step of several devices (harness/studies/split.py), into `trial` as each part is
    measured, so that a run stopped meanwhile keeps what was: its all-reduce alone, and for several processes, those
    processes run again alongside each other with nothing to share."""
    print("  its all-reduce alone ...", file=sys.stderr, flush=True)
    trial.update(allreduce_alone(spec, args.timeout, args.cluster))
    if spec.processes > 1:
        print("  its processes alongside ...", file=sys.stderr, flush=True)
        trial.update(alongside(spec, args.timeout, args.cluster, dataset["n_train"]))


def unfinished(args, specs, trials, wanted):
    """What an interrupted run finished, and where it is kept: the note under its last line."""
    done = sum(len(t) == w for t, w in zip(trials, wanted))
    files = " and ".join(filter(None, (args.json, args.csv)))
    trials_done = f" ({sum(map(len, trials))} of {sum(wanted)} trials)" if args.repeats > 1 else ""
    return f"{done} of {len(specs)} rows finished{trials_done}" + (
        f", kept in {files}; the same command with --resume runs the rest" if files else "")


def run_trial(spec, dataset, args, label, trial=0):
    """One trial (counted from 0) of one row: its processes launched (this host's, with --hosts), restarted if they die
    (supervise_restarts), their records merged."""
    if args.profile:
        spec = spec.replace(profile=trace_folder(args.profile, spec, trial + 1 if args.repeats > 1 else None))
    result, records = supervise_restarts(spec, dataset, args, label)
    if args.cluster.nnodes > 1 and result["status"] == "ok":   # see host_sums
        result.update(hosts=list(args.cluster.hosts), node_rank=args.cluster.node_rank, **host_sums(records))
    return result


def supervise_restarts(spec, dataset, args, label):
    """(the merged result, the last attempt's records) of a row's processes. With --max-restarts, a run whose process
    died is stopped whole and started again from its last complete checkpoint, as torchrun restarts a group: the
    result counts the restarts and the time they cost (lost_seconds). Only a checkpoint this row wrote is resumed
    from (another run's in the same folder has the same name: other settings, other data); --timeout is the row's
    whole budget, restarts included, and a row that used it up is not restarted."""
    restarts, attempt, thrown_away, started = 0, spec, 0.0, time.time()
    while True:
        attempt_started = time.time()
        timeout = None if args.timeout is None else max(1.0, args.timeout - (attempt_started - started))
        records = run_workers(attempt, timeout, progress=progress_bar(label), stall_timeout=args.stall_timeout,
                              cluster=args.cluster)
        if sys.stdout.isatty():
            print("\r\033[K", end="", flush=True)   # the bar's line, cleared for the table
        result = merge_records(records, dataset["fingerprint"])
        if result["status"] != "failed" or restarts == args.max_restarts or result.get("timed_out"):
            break
        restarts += 1
        attempt = spec.replace(resume_from=latest_checkpoint(spec, say, written_since=started))
        thrown_away += time.time() - max(attempt_started, saved_at(attempt.resume_from))
        print(f"  failed: {one_line(result['error'])}\n  restart {restarts} of {args.max_restarts}, from "
              f"{os.path.basename(attempt.resume_from) if attempt.resume_from else 'the start'}", file=sys.stderr)
    if args.max_restarts:
        result["restarts"] = restarts
        if result["status"] == "ok":   # the work after each checkpoint resumed from, and the restarted startup
            result["lost_seconds"] = thrown_away + (result["startup_seconds"] if restarts else 0.0)
    return result, records


def saved_at(checkpoint):
    """When a checkpoint was written (the wall clock's seconds), 0 for none: what a failed attempt did after it
    is thrown away. A failed attempt that wrote nothing is lost whole, its startup with it."""
    return os.path.getmtime(checkpoint) if checkpoint else 0.0


def host_sums(records):
    """A host sees its own processes' records only, so its row's losses are over its share of every batch. Its
    row keeps their sums, so that the run's losses are all hosts' sums added up (the final weights, test
    accuracy and digest are the run's on every host)."""
    return {key: [float(sum(values)) for values in zip(*(r[key] for r in records))]
            for key in ("epoch_loss_sums", "epoch_sizes", "step_loss_sums", "step_sizes")}
