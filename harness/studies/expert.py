"""The project's steps against an expert's loop: what the recipe's visible split, all-reduce and update,
and each framework's engines, cost against the one step a performance-minded user writes (each framework's
expert.py).

    python -m harness.studies.expert [--frameworks pytorch,mxnet,tensorflow,jax] [--repeats 60] [--threads 2]

One worker process per framework (threads fixed before import, as a compare.py row), one device, batch 256 of the
synthetic set: the expert's step, the scratch step, the idiomatic loop and the built-in engine, each fed its own way
(numpy rows, or the framework's own input pipeline) and timed with the fetch of its batch, one after the other step
by step (drift hits them alike), after a warm-up; medians.
"""
import argparse
import itertools
import statistics
import sys
import time

from ..training.loop import MODES

BATCH, LR, WARMUP = 256, 0.01, 5


def endless(batches_of_epoch):
    """A runner's batches, epoch after epoch."""
    for epoch in itertools.count():
        yield from batches_of_epoch(epoch)


def in_turn(rows, warmup, repeats, sync, clock=time.perf_counter):
    """{row: seconds of each of its timed steps}, the rows' steps taken in turn, one of each per round. Each reading
    ends with `sync`: a step returns its loss as a host number, but an asynchronous engine (MXNet's) may still be
    running its backward and update then, and without the wait they would be timed in the next row's step."""
    seconds = {name: [] for name in rows}
    for i in range(warmup + repeats):
        for name, (feed, step) in rows.items():
            start = clock()
            step(next(feed))   # with the fetch of its batch: each mode is fed its own way
            sync()
            if i >= warmup:
                seconds[name].append(clock() - start)
    return seconds


def measure(fw, spec, devices):
    """Worker task 'expert': {row: {ms, expert_ms, ratio expert / row} or {error}} for each mode."""
    from common.batches import Order
    from common.data import load_dataset
    from common.interface import RosettaError
    from common.lenet import init_weights
    from common.optim import Optimizer
    from ..loader import load_module
    from ..spec import RunSpec
    from ..training.loop import Scratch, runner
    expert = load_module(fw.name, "expert")
    device = devices[0]
    data = load_dataset("synthetic", None, 8 * BATCH, 0)
    order = Order(len(data.y_train), BATCH, 0, 1)
    mine = expert.get_model(init_weights(0), device)
    numpy_rows = Scratch(fw, devices)
    numpy_rows.feed(data, order, 0, 1)
    rows = {"expert": (endless(numpy_rows.batches), lambda batch: expert.train_step(mine, *batch, device, LR, BATCH))}
    errors = {}
    for mode in MODES:
        try:
            run = runner(RunSpec(framework=fw.name, mode=mode, devices=1, batch_size=BATCH, lr=LR), fw, devices)
            run.start(init_weights(0), Optimizer(lr=LR))
            run.feed(data, order, 0, 1)
        except RosettaError as err:
            errors[mode] = str(err)
            continue
        rows[mode] = (endless(run.batches), lambda batch, run=run: run.step(batch, LR, BATCH))
    seconds = in_turn(rows, WARMUP, spec.repeats or 60, lambda: fw.sync(devices))
    expert_s = statistics.median(seconds.pop("expert"))
    out = {mode: {"error": error} for mode, error in errors.items()}
    for name, s in seconds.items():
        median = statistics.median(s)
        out[name] = {"ms": 1e3 * median, "expert_ms": 1e3 * expert_s, "ratio": expert_s / median}
    return {mode: out[mode] for mode in MODES if mode in out}


def main(argv=None):
    from common.interface import FRAMEWORKS
    from ..processes.launch import run_workers
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    names = [n for n in args.frameworks.split(",") if n]
    bad = [n for n in names if n not in FRAMEWORKS]
    if bad or not names:
        print(f"error: unknown framework {bad[0]!r}; choose from {', '.join(FRAMEWORKS)}" if bad else
              "error: --frameworks names none", file=sys.stderr)
        return 2
    failed = False
    print("| framework | row | ms per step | the expert's | expert / row |\n|---|---|---|---|---|")
    for name in names:
        (record,) = run_workers({"task": "expert", "framework": name, "devices": 1, "processes": 1,
                                 "threads": args.threads, "repeats": args.repeats}, timeout=1800)
        if record["status"] != "ok":
            print(f"| {name} | - | - | - | {record['status']}: {record.get('error')} |")
            failed = failed or record["status"] == "failed"
            continue
        for row, r in record["expert"].items():
            if "error" in r:
                print(f"| {name} | {row} | - | - | skipped: {r['error']} |")
            else:
                print(f"| {name} | {row} | {r['ms']:.1f} | {r['expert_ms']:.1f} | {r['ratio']:.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
