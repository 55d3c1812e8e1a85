"""The scratch step against an expert's loop (issue 22): how much the recipe's visible split, all-reduce and update
cost against the one compiled step a performance-minded user writes (a framework's expert.py; JAX's for now).

    python -m harness.expert [--frameworks jax] [--repeats 60]

One worker process per framework, threads as a compare.py row of one device: both steps on the same batches, one
after the other step by step (drift hits both alike), after a warm-up; medians. Then the built-in engine and the
idiomatic loop, timed the same way against the same expert step (1 device).
"""
import argparse
import statistics
import sys
import time

import numpy as np

from common.lenet import init_weights

BATCH = 256


def measure(fw, spec, devices):
    """Worker task 'expert': {row: {median ms, expert median ms, ratio expert / row}} for scratch, builtin, idiomatic."""
    from .loader import load_module
    load_module(fw.name, "execution").use("default")
    expert = load_module(fw.name, "expert")
    device = devices[0]
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((BATCH, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, BATCH))
               for _ in range(8)]
    lr = 0.01
    mine = expert.get_model(init_weights(0), device)
    steps = {"expert": lambda X, y: expert.train_step(mine, X, y, device, lr, BATCH)}
    replicas = [fw.get_params(init_weights(0), device)]
    steps["scratch"] = lambda X, y: fw.train_step(replicas, X, y, devices[:1], lr, BATCH)
    idiomatic = load_module(fw.name, "idiomatic")
    model = idiomatic.get_model(init_weights(0), devices[:1])
    steps["idiomatic"] = lambda X, y: idiomatic.train_step(model, X, y, devices[:1], lr, BATCH)
    builtin, pipeline = load_module(fw.name, "builtin"), load_module(fw.name, "pipeline")
    engine = builtin.get_model(init_weights(0), devices[:1])
    steps["builtin"] = lambda X, y: builtin.train_step(
        engine, pipeline.global_batch(engine.placement, devices[:1], X, y, len(y)), lr, BATCH)
    seconds = {name: [] for name in steps}
    for i in range(5 + (spec.repeats or 60)):
        X, y = batches[i % len(batches)]
        for name, step in steps.items():
            start = time.perf_counter()
            step(X, y)   # each returns a float: the step has finished
            if i >= 5:
                seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    return {name: {"ms": 1e3 * medians[name], "expert_ms": 1e3 * medians["expert"],
                   "ratio": medians["expert"] / medians[name]} for name in steps if name != "expert"}


def main(argv=None):
    from .launch import run_workers
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default="jax")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    print("| framework | row | ms per step | expert's ms | expert / row |\n|---|---|---|---|---|")
    for name in args.frameworks.split(","):
        (record,) = run_workers({"task": "expert", "framework": name, "devices": 1, "processes": 1,
                                 "threads": args.threads, "repeats": args.repeats}, timeout=900)
        if record["status"] != "ok":
            print(f"error: {name}: {record['status']}: {record.get('error')}", file=sys.stderr)
            return 1
        for row, r in record["expert"].items():
            print(f"| {name} | {row} | {r['ms']:.1f} | {r['expert_ms']:.1f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
