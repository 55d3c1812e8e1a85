"""How far would each engine scale past this machine? A model, fed by measurements made here.

    python -m harness.studies.projection        # measure (about 5 minutes), fit, predict: writes docs/scaling.md
                                    # and results/scaling.json

Measured here, per engine, with 2 processes on this machine: the time of one all-reduce of 4 KB (latency),
of this LeNet's gradients and of larger buffers (each framework's own scratch `allreduce`, which sums across processes with
its engine), and the compute time of one training step on one device of each model (the LeNet, the ResNet-18 at
width 8). Fitted: the latency-bandwidth model of a ring all-reduce over p processes, T(n, p) = 2(p-1) alpha +
2(p-1)/p n/B, whose p = 2 case is the line T = 2 alpha + n/B through the measurements. MXNet's dist_sync is not a
ring: every worker pushes to and pulls from the server, whose link carries all p pushes and pulls, T(n, p) =
2 alpha + p n/B with one server. A step's gradients take k such all-reduces, k alphas and n bytes in all: k is the
number of parameters (`--allreduce per-tensor`, the recipe) or of buckets (`bucketed`, common/buckets.py).
Predicted: the scaling efficiency t / (t + T) of a synchronous step (compute t, then the all-reduce, no
overlap: the recipe's order) for 2 to 64 GPUs, at stated link bandwidths and per-GPU step times: stated for the
LeNet (its GPU step is kernel launches, not arithmetic), from the spec's FLOPs at a stated sustained rate for d2l's
ResNet-18 (width 64, compute-bound). And for this machine, the 2-process efficiency of each model's measured step,
to set beside the measured scaling of the same rows (docs/results.md).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from common import resnet, zero
from common.buckets import BUCKET_MB, plan
from common.lenet import PARAM_SHAPES
from common.models import flops_per_image

MB = 2**20
LENET_BYTES = 4 * sum(int(np.prod(s)) for s in PARAM_SHAPES.values())   # float32 gradients of one step
SIZES = (4096, LENET_BYTES, 1 * MB, 16 * MB, 100 * MB)   # 4 KB: latency-bound, where alpha shows
GPUS = (2, 4, 8, 16, 32, 64)
# Stated, not measured: all-reduce bandwidth per GPU of common links, and per-GPU compute per step.
LINKS = {"NVLink-class, 200 GB/s": 200e9, "PCIe 4.0 x16, 25 GB/s": 25e9, "100 Gb/s network, 12 GB/s": 12e9,
         "10 Gb/s network, 1.2 GB/s": 1.2e9}
BATCH = 256
SUSTAINED = (100e12, 25e12)   # FLOP/s a GPU sustains on a compute-bound network: a recent one, an older one


def gradient_sizes(model, width=None):
    """The float32 gradient of every parameter, in elements: the spec's."""
    if model == "lenet":
        return [int(np.prod(s)) for s in PARAM_SHAPES.values()]
    return [w.size for w in resnet.init_weights(0, width).values()]


def collectives(sizes, allreduce):
    """All-reduces a step makes: one per parameter, or one per bucket."""
    return len(sizes) if allreduce == "per-tensor" else len(plan(sizes, BUCKET_MB * MB))


def gpu_step_times(model, width=None):
    """Per-GPU compute of one step of BATCH images: stated where launches decide (the LeNet's 13.5 MFLOP per image),
    the spec's FLOPs at each SUSTAINED rate for d2l's ResNet-18."""
    if model == "lenet":
        return (0.002, 0.010)
    return tuple(flops_per_image(model, width) * BATCH / rate for rate in SUSTAINED)


# name: (model, width); the models measured on this machine are the LeNet and the ResNet-18 at width 8
MODELS = {"this LeNet": ("lenet", None), "d2l's ResNet-18 (width 64)": ("resnet18", 64)}
MEASURED = {"lenet": ("lenet", None), "resnet18 w8": ("resnet18", 8)}
ALLREDUCE_MODES = ("per-tensor", "bucketed")
RING = {"pytorch": "gloo ring all-reduce", "tensorflow": "collective ring all-reduce (RING)",
        "jax": "XLA all-reduce over gloo", "mxnet": "ps-lite parameter server (1 server)"}


# ZeRO's stages (common/zero.py) past one machine: two layouts a sharded run is planned for, the memory a GPU has
STAGE_LAYOUTS = {"8 GPUs, NVLink-class": (8, 200e9), "2 x 8 GPUs over a 100 Gb/s network": (16, 12e9)}
GPU_BYTES = 80e9   # an 80 GB GPU
ADAMW_SLOTS = 2    # AdamW's two buffers: the state worth sharding


def stage_seconds(sizes, p, alpha, bandwidth, shard, k=1):
    """The model's communication time of one step at ZeRO's stage `shard` over a ring of p GPUs: the bytes a GPU
    sends (common.zero.volume: an all-reduce is a reduce-scatter and an all-gather, each (p-1)/p of the buffer) over
    the bandwidth, and (p-1) latencies for each of the stage's halves (2 at stages 0 and 2, 3 at 1 and 3), k
    collectives each. Stage 0 is allreduce_seconds' ring."""
    halves = 2 * zero.volume(sizes, 2, shard) // zero.volume(sizes, 2, "none")   # 2 or 3 collectives of half
    return halves * k * (p - 1) * alpha + zero.volume(sizes, p, shard) / bandwidth


def bytes_per_parameter(p, shard, slots=ADAMW_SLOTS):
    """What one GPU holds a parameter at a stage, float32 weights, gradients and optimizer state (activations apart):
    16 bytes replicated with AdamW, 16 / p fully sharded."""
    return sum(zero.memory([p * 10**6], slots, p, shard).values()) / (p * 10**6)


def timed(fn, sync, repeats, warmup):
    """Median and minimum seconds of fn() with the devices synchronised, after warm-up calls (first-call
    costs: compilation, key declaration, collective set-up). fn's result is held until the sync: JAX's sync
    waits for the arrays that are alive, and a result dropped at once may still be computing."""
    for _ in range(warmup):
        result = fn()
        sync()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync()
        seconds.append(time.perf_counter() - start)
    del result
    return {"median": statistics.median(seconds), "min": min(seconds), "repeats": repeats}


def to_host(tensor):
    """One framework tensor as a numpy array: MXNet's NDArray has asnumpy; torch, TensorFlow and JAX take np.asarray."""
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else np.asarray(tensor)


def measure_allreduce(fw, spec, rank, world, devices):
    """Worker task 'allreduce': one buffer of spec.bytes summed across the run's processes."""
    x = np.ones(spec.bytes // 4, np.float32)
    (tensor,) = fw.split_and_load(x, devices[:1])
    (first,) = fw.allreduce([tensor])
    total = to_host(first)
    if not np.all(total == world):
        raise RuntimeError(f"the all-reduce summed to {float(total.flat[0])}, not {world}")
    repeats = spec.repeats or (5 if spec.bytes >= 16 * MB else 20)
    return timed(lambda: fw.allreduce([tensor]), lambda: fw.sync(devices), repeats, warmup=2)


def measure_step(fw, spec, devices):
    """Worker task 'step': one scratch training step of spec.model (batch 256, one device), the compute an
    all-reduce would follow."""
    from common.interface import StepSettings
    from common.models import init_bn_state, init_weights

    from ..loader import load_module
    from ..training.loop import functional, network_of
    model = functional(fw, network_of(spec))
    settings = StepSettings(units=load_module(fw.name, "execution").compile("default", model))
    rng = np.random.default_rng(0)
    X = rng.standard_normal((spec.batch_size, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, len(X))
    replicas = [model.get_params(init_weights(spec.model, 0, width=spec.width), devices[0])]
    bn_states = [model.get_bn_state(init_bn_state(spec.model, spec.width), devices[0])]
    step = lambda: fw.train_step(model, replicas, bn_states, X, y, devices[:1], 0.01, settings=settings)   # noqa: E731
    return timed(step, lambda: fw.sync(devices), spec.repeats or (20 if spec.model == "lenet" else 10), warmup=3)


def allreduce_seconds(n, p, alpha, bandwidth, framework=None, k=1):
    """The model's time to all-reduce n bytes over p processes in k collectives (a ring, or MXNet's one-server
    push-pull): k latencies, the bytes once."""
    if framework == "mxnet":
        return k * 2 * alpha + p * n / bandwidth
    return k * 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth


def fit(sizes, seconds, framework=None):
    """alpha (s) and B (bytes/s) of the model at p = 2, T = 2 alpha + c n / B (c = 1 for a ring, 2 for the
    one-server push-pull), least squares on relative error: the sizes span three orders of magnitude, and
    a plain fit would ignore the small ones. A latency cannot be negative: where the free fit says so (a
    transport whose small messages are relatively slow), alpha is 0 and the line goes through the origin."""
    n, t = np.asarray(sizes, float), np.asarray(seconds, float)
    A = np.stack([np.full_like(n, 2.0), n], axis=1) / t[:, None]
    (alpha, slope), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, (slope,) = 0.0, np.linalg.lstsq(A[:, 1:], np.ones_like(t), rcond=None)[0]
    c = allreduce_seconds(1.0, 2, 0.0, 1.0, framework)
    return float(alpha), float(c / slope) if slope > 0 else float("inf")


def efficiency(step_seconds, n, p, alpha, bandwidth, framework=None, k=1):
    """Scaling efficiency of a synchronous data-parallel step: compute, then the all-reduce, no overlap."""
    return step_seconds / (step_seconds + allreduce_seconds(n, p, alpha, bandwidth, framework, k))


def measure(frameworks, sizes=SIZES, timeout=600):
    """Every input of the model, each measurement in fresh worker processes (the engine's own launch)."""
    from common.interface import RosettaError
    from ..processes.launch import run_workers
    threads = max(1, (os.cpu_count() or 2) // 2)
    results = {}
    for name in frameworks:
        steps = {}
        for label, (model, width) in MEASURED.items():
            print(f"{name}: one {label} step ...", file=sys.stderr, flush=True)
            (step,) = run_workers({"task": "step", "framework": name, "model": model, "width": width,
                                   "devices": 1, "processes": 1, "threads": threads}, timeout)   # a process's cores
            if step["status"] != "ok":
                raise RosettaError(f"{name}: the {label} step measurement {step['status']}: {step['error']}")
            steps[label] = step["step"]
        points = []
        for n in sizes:
            print(f"{name}: all-reduce of {n / MB:.2f} MB across 2 processes ...", file=sys.stderr, flush=True)
            spec = {"task": "allreduce", "framework": name, "devices": 2, "processes": 2, "bytes": int(n),
                    "threads": threads}
            records = run_workers(spec, timeout)
            if records[0]["status"] != "ok":
                raise RosettaError(f"{name}: the all-reduce of {n} bytes {records[0]['status']}: {records[0]['error']}")
            points.append({"bytes": int(n), **records[0]["allreduce"]})
        alpha, bandwidth = fit([p["bytes"] for p in points], [p["median"] for p in points], name)
        results[name] = {"engine": RING[name], "step": steps["lenet"], "steps": steps, "allreduce": points,
                         "alpha": alpha, "bandwidth": bandwidth}
    return results


def markdown(results, env_line, command):
    """docs/scaling.md, generated: the measured inputs, the fitted model and its predictions."""
    sizes = [p["bytes"] for p in next(iter(results.values()))["allreduce"]]
    out = ["# Scaling past one machine: a model from measured inputs\n",
           "**This page is a model, not a measurement of GPUs.** Its inputs were measured on one CPU machine "
           "(below); its predictions assume the stated link bandwidths and per-GPU step times. Where a GPU "
           "machine is available, measure instead and compare.\n",
           f"Re-measure the inputs and regenerate this page: `{command}`\n", f"Measured on: {env_line}\n",
           "## Measured here (2 processes on one machine, loopback)\n",
           "| framework | engine | " + " | ".join(f"one {label} step, batch {BATCH}, 1 core (ms)" for label in MEASURED)
           + " | " + " | ".join(f"all-reduce {n / MB:.3g} MB (ms)" for n in sizes)
           + " | fitted alpha (us) | fitted B (GB/s) |",
           "|---|---|" + "---|" * (len(MEASURED) + len(sizes)) + "---|---|"]
    for name, r in results.items():
        out.append(f"| {name} | {r['engine']} | "
                   + " | ".join(f"{1e3 * r['steps'][label]['median']:.1f}" for label in MEASURED) + " | "
                   + " | ".join(f"{1e3 * p['median']:.2f}" for p in r["allreduce"])
                   + f" | {1e6 * r['alpha']:.0f} | {r['bandwidth'] / 1e9:.2f} |")
    out += ["", "alpha is the engine's fixed cost per ring step (its software latency here: Python, the "
            "framework's dispatch, the transport's handshakes); B is the bandwidth the engine reached between "
            "two processes through this machine's memory. The fit is the model at p = 2: "
            "`T = 2 alpha + n / B` for a ring, `T = 2 alpha + 2 n / B` for MXNet's one server. A step pays alpha "
            "once per collective: k of them, one per parameter (`--allreduce per-tensor`, the recipe) or one per "
            f"{BUCKET_MB} MiB bucket (`--allreduce bucketed`, DDP's way).", "",
            "## This machine: 2 processes with a core each, predicted", "",
            "The measured one-core step t and this machine's alpha and B at p = 2, for the scratch rows of 2 "
            "processes (`python compare.py --model <m> --devices 2 --processes 2 --cores per-device --allreduce "
            "per-tensor,bucketed`): efficiency per-tensor / bucketed. The measured rows are in docs/results.md; "
            "where a measured figure falls below its prediction, the step loses time the model does not hold "
            "(waiting for the slower process, the framework's own overheads across processes).", "",
            "| engine | " + " | ".join(f"{label}: {4 * sum(gradient_sizes(*m)) / MB:.2f} MB in "
                                      f"{collectives(gradient_sizes(*m), 'per-tensor')} / "
                                      f"{collectives(gradient_sizes(*m), 'bucketed')} all-reduces"
                                      for label, m in MEASURED.items()) + " |",
            "|---|" + "---|" * len(MEASURED)]
    for name, r in results.items():
        cells = []
        for label, m in MEASURED.items():
            sizes_m = gradient_sizes(*m)
            n, t = 4 * sum(sizes_m), r["steps"][label]["median"]
            cells.append(" / ".join(f"{efficiency(t, n, 2, r['alpha'], r['bandwidth'], name, collectives(sizes_m, a)):.2f}"
                                    for a in ALLREDUCE_MODES))
        out.append(f"| {name} ({r['engine']}) | " + " | ".join(cells) + " |")
    out += ["", "## Predicted scaling efficiency on GPUs", "",
            "Efficiency = t / (t + T(n, p)): one synchronous step of compute t per GPU, then the all-reduce of "
            "n bytes of gradients over p GPUs in k collectives, with each engine's alpha measured here and the "
            "link's bandwidth in place of B. No overlap of communication with the backward pass is assumed "
            "(DistributedDataParallel overlaps buckets with it, so it can do better; the scratch recipe cannot). "
            "Rows: engine and link; columns: GPUs; each cell per-tensor / bucketed. The LeNet's step times are "
            "stated (kernel launches decide them); the ResNet's are the spec's FLOPs per step "
            f"({BATCH} images) at a sustained {', '.join(f'{r / 1e12:.0f}' for r in SUSTAINED)} TFLOP/s.", ""]
    for model, (name_m, width) in MODELS.items():
        sizes_m = gradient_sizes(name_m, width)
        n, ks = 4 * sum(sizes_m), [collectives(sizes_m, a) for a in ALLREDUCE_MODES]
        for t in gpu_step_times(name_m, width):
            out += [f"### {model} ({n / MB:.2f} MB of gradients in {ks[0]} / {ks[1]} all-reduces), "
                    f"{1e3 * t:.0f} ms of compute per step", "",
                    "| engine | link | " + " | ".join(f"{p} GPUs" for p in GPUS) + " |",
                    "|---|---|" + "---|" * len(GPUS)]
            for name, r in results.items():
                for link, bandwidth in LINKS.items():
                    out.append(f"| {name} ({r['engine']}) | {link} | "
                               + " | ".join(" / ".join(f"{efficiency(t, n, p, r['alpha'], bandwidth, name, k):.2f}"
                                                      for k in ks) for p in GPUS) + " |")
            out.append("")
    out += stages_markdown(results)
    out += ["## How to read it", "",
            "- At this LeNet's size (half a megabyte) every engine is latency-bound: the bandwidth term is "
            "microseconds on any modern link, and the alphas decide. An engine whose alpha is a millisecond "
            "cannot keep a 2 ms step efficient past a few GPUs, whatever the link; eight all-reduces a step "
            "cost eight alphas, one bucket one.",
            "- For d2l's ResNet-18 (43 MB of gradients) the bandwidth term takes over on slow links, and the link "
            "decides: compare the rows of one engine across links. Its 76 parameters per-tensor pay 76 alphas a "
            "step; bucketed, 2.",
            "- MXNet's one-server parameter server grows linearly with p: the server's link carries every "
            "worker's push and pull. ps-lite spreads keys over several servers (DMLC_NUM_SERVER), which divides "
            "that term; this repo starts one server.",
            "- alpha here is a CPU engine's (gloo, gRPC ring, ps-lite) on loopback; NCCL on GPUs has a far smaller "
            "fixed cost, so these rows are pessimistic for GPU engines at small sizes.", ""]
    return "\n".join(out)


def stages_markdown(results):
    """The ZeRO stages' section: what a GPU holds and sends a step at each, d2l's ResNet-18 with AdamW projected to
    8 GPUs and to 2 x 8 over a network with PyTorch's measured alpha (FSDP's engine, gloo here: NCCL's is smaller),
    and where stage 3 starts to pay."""
    name = "pytorch" if "pytorch" in results else next(iter(results))
    alpha = results[name]["alpha"]
    sizes = gradient_sizes("resnet18", 64)
    n, k, t = 4 * sum(sizes), collectives(sizes, "bucketed"), gpu_step_times("resnet18", 64)[0]
    out = ["## ZeRO's stages past one machine (`--shard`)", "",
           f"d2l's ResNet-18 ({n / MB:.1f} MB of float32 weights) with AdamW ({ADAMW_SLOTS} buffers a weight), "
           f"bucketed ({k} buckets), {1e3 * t:.0f} ms of compute a step; {name}'s alpha measured here "
           f"({1e6 * alpha:.0f} us), the link's bandwidth. Held: what one GPU keeps between steps (weights, "
           "gradients after their reduction, optimizer state; activations apart); sent: the bytes one GPU sends a "
           "step in a ring (common/zero.py's volume); efficiency t / (t + T), no overlap.", "",
           "| stage | " + " | ".join(f"{layout}: held / sent / efficiency" for layout in STAGE_LAYOUTS) + " |",
           "|---|" + "---|" * len(STAGE_LAYOUTS)]
    for shard in zero.SHARDS:
        cells = []
        for p, bandwidth in STAGE_LAYOUTS.values():
            held = sum(zero.memory(sizes, ADAMW_SLOTS, p, shard).values())
            comm = stage_seconds(sizes, p, alpha, bandwidth, shard, k)
            cells.append(f"{held / MB:.1f} MB / {zero.volume(sizes, p, shard) / MB:.1f} MB / {t / (t + comm):.2f}")
        out.append(f"| {zero.stage(shard)} ({shard}) | " + " | ".join(cells) + " |")
    out += ["", f"Where stage 3 starts to pay. It sends half as much again as the all-reduce (two all-gathers of "
            "the weights and a reduce-scatter of the gradients), so it never pays in time; it pays when the model "
            f"does not fit otherwise. The largest model whose float32 weights, gradients and AdamW state fit in an "
            f"{GPU_BYTES / 1e9:.0f} GB GPU, activations apart:", "",
            "| stage | bytes a parameter holds | " + " | ".join(f"{layout}: largest model" for layout in STAGE_LAYOUTS)
            + " |", "|---|---|" + "---|" * len(STAGE_LAYOUTS)]
    for shard in zero.SHARDS:
        per = [bytes_per_parameter(p, shard) for p, _ in STAGE_LAYOUTS.values()]
        out.append(f"| {zero.stage(shard)} ({shard}) | " + " / ".join(f"{b:.3g}" for b in per) + " | "
                   + " | ".join(f"{GPU_BYTES / b / 1e9:.1f} B parameters" for b in per) + " |")
    out += ["", "A model above stage 2's limit trains only at stage 3 (or with mixed precision, offloading or "
            "model parallelism): that is where stage 3 starts to pay. Below it, stage 2 fits at the all-reduce's "
            "volume, and stage 3's further saving, the weights, buys only room for activations or a larger batch, "
            "at half as much traffic again. d2l's ResNet-18 is hundreds of times below every limit: on GPUs it "
            "trains replicated, sharded only to learn how.", ""]
    return out


def main(argv=None):
    from common.interface import FRAMEWORKS, RosettaError
    from ..loader import ROOT, installed_version
    from ..publishing.provenance import environment, environment_line
    from ..files import replaced_atomically
    p = argparse.ArgumentParser(description="Measure the inputs of the scaling model and write docs/scaling.md")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "scaling.md"))
    p.add_argument("--json", default=os.path.join("results", "scaling.json"))
    args = p.parse_args(argv)
    names = [n for n in args.frameworks.split(",") if n]
    try:
        bad = [n for n in names if n not in FRAMEWORKS]
        if bad:
            raise RosettaError(f"unknown framework {bad[0]!r}; choose from {', '.join(FRAMEWORKS)}")
        names = [n for n in names if installed_version(n)]
        results = measure(names)
    except RosettaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = environment()
    with replaced_atomically(args.json) as f:   # the folder made, the previous file kept if this stops midway
        json.dump({"environment": env, "results": results}, f, indent=1)
    with replaced_atomically(args.out) as f:
        f.write(markdown(results, environment_line(env), "python -m harness.studies.projection"))
    print(f"wrote {args.out} and {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
