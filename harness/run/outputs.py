"""The files a command writes (--json, --csv, --plot, the benchmark's markdown): checked before the first row,
rewritten whole after every finished trial, so that an interrupted run leaves valid files behind."""
import json
import os

from common.interface import RosettaError

from ..studies.benchmark import ROW_KEY, add_peak_fraction, add_scaling, aggregate, write_csv
from ..files import is_stream, replaced_atomically, unwritable, unwritable_directory
from .plan import BENCHMARK_MD
from ..publishing.provenance import environment_line
from ..publishing.tables import add_parity, format_scaling, format_split, format_table
from .resume import settings
from ..studies.split import add_split


def output_paths(args):
    """Every file the command writes, by the option that asks for it."""
    paths = {"--json": args.json, "--csv": args.csv, "--plot": args.plot,
             "--benchmark": BENCHMARK_MD if args.benchmark else None}
    return {option: path for option, path in paths.items() if path}


def output_directories(args):
    """Every directory the rows write into (checkpoints, profiler traces), by the option that names it."""
    paths = {"--checkpoint-dir": getattr(args, "checkpoint_dir", None), "--profile": getattr(args, "profile", None)}
    return {option: path for option, path in paths.items() if path}


def check_outputs(args):
    """Every output writable (and the plot's format one matplotlib writes) before the first row and
    before the data loads: a bad path costs seconds, not a finished run. Two options naming one file would write it
    in turn, the last one's kept (a CSV in the --json file, which --resume cannot read): refused."""
    named = {}
    for option, path in output_paths(args).items():
        if is_stream(path):   # --json /dev/stdout --csv /dev/stdout: both printed, one after the other
            continue
        same = named.setdefault(os.path.realpath(path), option)
        if same != option:
            raise RosettaError(f"{same} and {option} name the same file, {path}: give each its own")
    for option, path in output_paths(args).items():
        problem = unwritable(path)
        if problem:
            raise RosettaError(f"cannot write {option} {path}: {problem}")
    for option, path in output_directories(args).items():
        problem = unwritable_directory(path)
        if problem:
            raise RosettaError(f"cannot write into {option} {path}: {problem}")
    if args.plot:
        from ..publishing.plots import image_format
        image_format(args.plot)


def write_results(args, env, dataset, specs, labels, trials, wanted):
    """Write the requested files as they stand (every row with a trial done, and which rows are still to
    run); return those rows. Called after every trial: an interrupted run leaves valid files."""
    rows = [aggregate(t) if t else {**{k: getattr(spec, k) for k in ROW_KEY}, "status": "not run", "error": None}
            for (spec, _), t in zip(specs, trials)]
    runs = [row for row, t in zip(rows, trials) if t]
    not_run = [label + (f" ({len(t)} of {w} trials done)" if t else "")
               for label, t, w in zip(labels, trials, wanted) if len(t) < w]
    add_scaling(runs)
    add_parity(runs)
    add_peak_fraction(runs, env.get("calibration"))
    add_split(runs)
    write_files(args, {"environment": env, "settings": settings(args), "dataset": dataset,
                       "complete": not not_run, "not_run": not_run, "runs": runs}, rows)
    return runs


def write_files(args, content, rows):
    """The JSON file (`content`), the CSV (`rows`: a "not run" line for a row still to run) and the
    benchmark's markdown, each replaced atomically. The plot is drawn once, at the end (compare.report); so
    is a stream (--json /dev/stdout), which cannot be replaced, only appended to."""
    final = not content.get("not_run")
    if args.json and (final or not is_stream(args.json)):
        with replaced_atomically(args.json) as f:
            json.dump(content, f, indent=2)
    if args.csv and (final or not is_stream(args.csv)):
        write_csv(args.csv, rows, content["environment"])
    if args.benchmark:
        env, runs = content["environment"], content["runs"]
        with replaced_atomically(BENCHMARK_MD) as f:
            f.write(f"Command: `python {env['command']}`\n\nEnvironment: {environment_line(env)}\n\n"
                    f"{format_table(runs, timing=True, markdown=True)}\n")
            if format_scaling(runs):
                f.write(f"\nScaling (cores shared: every op may use every thread; a core per device: each device "
                        f"pinned to cores of its own):\n\n{format_scaling(runs)}\n")
            if format_split(runs):
                f.write(f"\nWhere each step of several devices goes (harness/studies/split.py):\n\n"
                        f"{format_split(runs)}\n")
            if content.get("not_run"):
                f.write(f"\nIncomplete: not run yet: {'; '.join(content['not_run'])}\n")
