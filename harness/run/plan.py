"""The rows a command asks for: the options' grid (modes x exec levels x layouts x devices and processes x
cores settings x frameworks), or the benchmark's plan, as RunSpecs, each with the reason it cannot run."""
import itertools
import os

from common.buckets import BUCKETING_ENGINES
from common.precision import WIRE_ENGINES
from common.zero import SHARD_ENGINES
from common.interface import RosettaError

from ..processes.cores import per_device_threads
from ..processes.launch import process_per_device
from ..spec import RMSPROP_FIELDS, SCHEDULE_FIELDS, RunSpec, default, variant

BATCH_SIZE = default("batch_size")   # a row of another global batch says so in its label

EXEC_OPTIONS = ("default", "eager", "graph", "xla")
LAYOUT_OPTIONS = ("default", "nchw", "nhwc")   # memory layout of images and conv kernels: channels first or last
# --benchmark: synthetic images, batch 256, 3 trials. With the cores shared (every op may use every core):
# every execution mode on one device, the idiomatic reference loops, the default mode and the built-in engines
# (fed by their frameworks' own input pipelines) on 1 and 2 devices. With a core per device: the default mode on
# 1 device, 2 devices and 2 processes, and the built-in engines on 1 device and 2 processes: real parallel
# speed-up, if any, each engine against itself on 1 device (an engine may run its framework's own, faster layers).
# And the scratch step in channels-first memory (NCHW), against the rows above in each framework's default
# layout (channels-last but in MXNet, whose NCHW row is then the same run twice: the noise between two rows),
# and its 2 processes with the bucketed all-reduce, against the per-tensor row above.
# Plan entries: (mode, exec levels, (devices, processes) shapes, cores, layouts[, all-reduces: per-tensor if absent]).
BENCHMARK_MD = os.path.join("results", "benchmark.md")
BENCHMARK = {"dataset": "synthetic", "n_synthetic": 30000, "epochs": 1, "batch_size": 256, "repeats": 3,
             "plan": [("scratch", ("eager", "graph", "xla"), ((1, 1),), "shared", ("default",)),
                      ("scratch", ("default",), ((1, 1),), "shared", ("nchw",)),
                      ("idiomatic", ("default",), ((1, 1),), "shared", ("default",)),
                      ("scratch", ("default",), ((2, 1),), "shared", ("default",)),
                      ("builtin", ("default",), ((1, 1), (2, 1)), "shared", ("default",)),
                      ("scratch", ("default",), ((1, 1), (2, 1), (2, 2)), "per-device", ("default",)),
                      ("scratch", ("default",), ((2, 2),), "per-device", ("default",), ("bucketed",)),
                      ("builtin", ("default",), ((1, 1), (2, 2)), "per-device", ("default",))]}
BENCHMARK_IMAGES = {"resnet18": 5120}   # the ResNet's step is ~20x the LeNet's: 20 steps a trial, not 117


def benchmark_plan(plan, model):
    """The benchmark's entries for a model: the ResNet's scratch step runs its framework's default exec level only."""
    if model == "lenet":
        return plan
    return [(mode, ("default",), *rest) for mode, _, *rest in plan]


def grid(args):
    """The plan entries of the command line's options (the benchmark brings its own)."""
    return [(mode, tuple(args.exec), tuple(itertools.product(args.devices, args.processes)), cores,
             tuple(args.layout), tuple(args.allreduce)) for cores in args.cores for mode in args.mode]


def check_data(args, dataset):
    """Enough training images for one batch: fewer trains rows of zero or one step and calls them ok."""
    if dataset["n_train"] < args.batch_size:
        more = "raise --n-synthetic or " if args.dataset == "synthetic" else ""
        raise RosettaError(f"the {dataset['name']} training set has {dataset['n_train']} images, fewer than one "
                           f"batch of {args.batch_size}: {more}lower --batch-size")


def run_specs(args):
    """Every requested row as (spec, reason it cannot run or None)."""
    share = per_device_threads(args.threads, max(args.devices))   # each device's cores, per-device rows
    usable = len(os.sched_getaffinity(0))
    seen = {}
    for mode, levels, shapes, cores, layouts, *allreduces in args.plan:
        for level, layout, allreduce, shard, accumulate, precision, wire, bn, per_device, (devices, processes), name \
                in itertools.product(levels, layouts, allreduces[0] if allreduces else ("per-tensor",), args.shard,
                                     args.accumulate, args.precision, args.allreduce_dtype, args.bn,
                args.per_device_batch or [None], shapes, args.frameworks):
            world = devices if process_per_device(name, mode, processes) else processes
            threads = share * devices // world if cores == "per-device" else args.threads // world
            spec = RunSpec(framework=name, model=args.model, width=args.width, bn=bn, mode=mode, exec=level,
                           layout=layout, allreduce=allreduce, shard=shard, accumulate=accumulate,
                           precision=precision,
                           allreduce_dtype=wire, loss_scale=args.loss_scale, loss_scale_interval=args.loss_scale_interval, devices=devices,
                           processes=world,
                           cores=cores, threads=max(1, threads), dataset=args.dataset, data_dir=args.data_dir,
                           n_synthetic=args.n_synthetic, epochs=args.epochs, lr=args.lr,
                           batch_size=per_device * devices if per_device else args.batch_size,
                           optimizer=args.optimizer, momentum=args.momentum, weight_decay=args.weight_decay,
                           **{name: getattr(args, name) for name in RMSPROP_FIELDS},
                           lr_schedule=args.lr_schedule, warmup_epochs=args.warmup_epochs, clip_norm=args.clip_norm,
                           **{name: getattr(args, name) for name in SCHEDULE_FIELDS},
                           lr_scaling=args.lr_scaling, reference_batch=args.reference_batch,
                           target_accuracy=args.target_accuracy, seed=args.seed, init=args.init, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every, resume_from=args.resume_from)
            yield spec, skip_reason(spec, share, usable, max(args.devices), args.threads, seen)
            seen.setdefault(spec, row_label(spec))


def skip_reason(spec, share, usable, most_devices, threads, seen):
    """Why a planned row cannot run (a skipped row in the table), or None."""
    if spec.devices % spec.processes:
        return f"{spec.devices} devices cannot be shared evenly among {spec.processes} processes"
    if spec.mode != "scratch" and spec.exec != "default":
        return f"exec levels apply to the scratch mode; {spec.mode} runs its framework's own way"
    if spec.mode != "scratch" and spec.layout != "default":
        return f"layouts apply to the scratch mode; {spec.mode} runs in its framework's own layout"
    if spec.allreduce != "per-tensor" and spec.mode != "scratch" and not (
            spec.mode == "builtin" and spec.framework in BUCKETING_ENGINES):
        return f"--allreduce is the scratch step's; {spec.mode} sums the gradients its framework's own way"
    if spec.shard != "none" and spec.mode == "idiomatic":
        return "--shard: the idiomatic reference loop is single-device"
    if spec.shard != "none" and spec.mode == "builtin" and spec.shard not in SHARD_ENGINES.get(spec.framework, ()):
        return (f"--shard {spec.shard}: {spec.framework} has no built-in engine for it (common.zero.SHARD_ENGINES); "
                "its scratch step shards")
    if spec.allreduce_dtype != "fp32" and spec.devices == 1:
        return "--allreduce-dtype: one device has no all-reduce"
    if spec.allreduce_dtype != "fp32" and spec.mode == "builtin" and spec.framework not in WIRE_ENGINES:
        return (f"--allreduce-dtype {spec.allreduce_dtype}: {spec.framework}'s engine all-reduces in its variables' "
                "dtype, with no option for another")
    if spec.mode == "idiomatic" and (spec.devices, spec.processes) != (1, 1):
        return "the idiomatic reference loop is single-device, single-process"
    if spec.cores == "per-device" and (share < 1 or share * spec.devices > usable):
        return (f"a core per device: {most_devices} devices need {most_devices} of --threads {threads}, "
                f"{usable} usable cores here")
    if spec in seen:
        return f"the same run as {seen[spec]} ({spec.framework} {spec.mode} runs one process per device)"
    return None


def row_label(spec):
    model = "" if spec.model == "lenet" else f"{spec.model} w{spec.width} {spec.bn} BN, "
    layout = ("" if spec.layout == "default" else f", {spec.layout}") + variant(spec)
    per_device = ", a core per device" if spec.cores == "per-device" else ""
    batch = "" if spec.batch_size == BATCH_SIZE else f", batch {spec.batch_size}"
    return (f"{spec.framework} {spec.mode} ({model}{spec.exec}{layout}), {spec.devices} device(s){batch}, "
            f"{spec.processes} process(es){per_device}")
