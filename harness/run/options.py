"""Every option of compare.py and its constraints, in one place: the options by group (--help shows them so), then
each check, a bad value or combination answered with one line and exit status 2 before anything runs. What a single
run may be (a network, its width, BatchNorm and init; an all-reduce) is common/models.py's and harness/spec.py's, which
a hand-written worker spec meets too; this module asks them rather than saying it again."""
import os

from common.buckets import ALLREDUCES, BUCKET_MB
from common.data import DATASETS
from common.interface import FRAMEWORKS, RosettaError
from common.lenet import INITS
from common.models import BN_MODES, DEFAULT_WIDTH, MODELS, RESNET_SGD_LR, check
from common.optim import DEFAULT_LR, LR_SCALINGS, OPTIMIZERS, SCHEDULES, default_momentum, scaled_lr
from common.precision import PRECISIONS, WIRE_DTYPES
from common.zero import SHARDS

from ..cli import HelpFormatter, Parser, float_list, host_list, int_list, name_list
from ..processes.cluster import DEFAULT_PORT, ONE_HOST, Cluster
from ..processes.cores import CORES
from .plan import BENCHMARK, BENCHMARK_IMAGES, EXEC_OPTIONS, LAYOUT_OPTIONS, benchmark_plan, grid
from ..spec import default, default_epochs, default_lr
from ..training.loop import MODES


def parse_args(argv, description=None):
    """compare.py's options, grouped as --help shows them, each checked here (one line and exit 2 for a bad one)."""
    p = Parser(description=description, formatter_class=HelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--frameworks", type=name_list(FRAMEWORKS, "framework"), default=",".join(FRAMEWORKS),
                   help="comma-separated")
    g.add_argument("--model", choices=tuple(MODELS), default=default("model"),
                   help="the network: the recipe's LeNet, or d2l's ResNet-18 with BatchNorm (common/models.py)")
    g.add_argument("--width", type=int, help=f"the ResNet's channels in its first stage (default {DEFAULT_WIDTH}; "
                                             "d2l's is 64)")
    g.add_argument("--bn", type=name_list(BN_MODES, "BatchNorm mode"), default=default("bn"),
                   help="the ResNet's BatchNorm across replicas: local (each normalises by its shard's statistics), "
                        "sync (by the global batch's, all-reduced across devices and processes); comma-separated")
    g.add_argument("--dataset", choices=DATASETS, default=default("dataset"), help="the data set (see docs/usage.md)")
    g.add_argument("--data-dir", help="folder with the IDX files (fashion-mnist, mnist)")
    g.add_argument("--n-synthetic", type=int, default=default("n_synthetic"), help="training images of the synthetic set")
    g.add_argument("--seed", type=int, default=default("seed"), help="initial weights and batch order")
    g.add_argument("--init", choices=INITS, default=default("init"), help="he, or the recipe's normal(0, 0.01)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--epochs", type=int, help="default 30 for digits, 10 otherwise")
    g.add_argument("--batch-size", type=int, default=default("batch_size"), help="global batch, split across devices")
    g.add_argument("--per-device-batch", type=int_list, metavar="N",
                   help="instead of --batch-size: each row's global batch is N x its devices (weak scaling); "
                        "comma-separated, a row per N")
    g.add_argument("--lr", type=float, help="the base learning rate; default by --optimizer: "
                   + ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())
                   + "; " + ", ".join(f"{model}'s sgd {lr:g}" for model, lr in RESNET_SGD_LR.items()))
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=default("optimizer"),
                   help="the update, PyTorch's conventions in every framework (common/optim.py)")
    g.add_argument("--momentum", type=float, help="momentum's and nesterov's (default 0.9), rmsprop's (default 0: none)")
    g.add_argument("--rmsprop-alpha", type=float, metavar="A", default=default("rmsprop_alpha"),
                   help="rmsprop: the squares' running average keeps A of itself each step (torch's alpha; Gluon's "
                        "gamma1, Keras's rho, Optax's decay)")
    g.add_argument("--rmsprop-centered", action="store_true",
                   help="rmsprop: divide by the gradients' running variance, not their second moment")
    g.add_argument("--weight-decay", type=float, default=default("weight_decay"),
                   help="L2 added to the gradient; decoupled (w -= lr * wd * w) for adamw")
    g.add_argument("--lr-schedule", choices=SCHEDULES, default=default("lr_schedule"),
                   help="per step: constant, step (x0.1 at 1/2 and 3/4 of the steps after warm-up), cosine (to 0), "
                        "factor (x0.1 every 1/4 of them), poly (power 2, to 0); the --lr-decay-*, --lr-power and "
                        "--lr-final options below set them")
    g.add_argument("--warmup-epochs", type=float, default=default("warmup_epochs"),
                   help="linear warm-up, per step, from lr / warm-up steps to lr")
    g.add_argument("--lr-decay-at", type=float_list, metavar="E,E", default=default("lr_decay_at"),
                   help="step: its milestones, in epochs from the start (default: 1/2 and 3/4 of the epochs after "
                        "the warm-up)")
    g.add_argument("--lr-decay-every", type=float, metavar="E", default=default("lr_decay_every"),
                   help="factor: a decay every E epochs after the warm-up (default: a quarter of them)")
    g.add_argument("--lr-decay-factor", type=float, metavar="F", default=default("lr_decay_factor"),
                   help="step, factor: the rate's multiplier at each decay")
    g.add_argument("--lr-power", type=float, metavar="P", default=default("lr_power"), help="poly: its power")
    g.add_argument("--lr-final", type=float, metavar="LR", default=default("lr_final"), help="cosine: its last rate")
    g.add_argument("--clip-norm", type=float, help="clip the all-reduced mean gradient to this global norm")
    g.add_argument("--lr-scaling", choices=LR_SCALINGS, default=default("lr_scaling"),
                   help="linear: lr times global batch / --reference-batch (the linear scaling rule)")
    g.add_argument("--reference-batch", type=int, default=default("reference_batch"),
                   help="the global batch --lr is meant for, with --lr-scaling linear")
    g.add_argument("--target-accuracy", type=float, metavar="A",
                   help="evaluate after every epoch (outside the timers) and report the training seconds until the "
                        "test accuracy first reached A (time to accuracy, e.g. 0.85 on fashion-mnist)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--mode", type=name_list(tuple(MODES), "mode"), default=default("mode"),
                   help="scratch (the recipe), builtin (the framework's own engine), "
                        "idiomatic (its minimal single-device loop, the timing reference)")
    g.add_argument("--devices", type=int_list, default="2", help="device counts, e.g. 1,2")
    g.add_argument("--processes", type=int_list, default="1",
                   help="process counts, e.g. 1,2: the devices are shared out among them")
    g.add_argument("--allreduce", type=name_list(ALLREDUCES, "all-reduce"), default=default("allreduce"),
                   help="how the scratch step sums the gradients across devices and processes: per-tensor (the "
                        "recipe: one all-reduce per parameter) or bucketed (DDP's way: flattened into buckets of "
                        f"{BUCKET_MB} MiB, one all-reduce each; common/buckets.py); also JAX's built-in step, whose "
                        "psum is written by hand (the others sum their own way); comma-separated")
    g.add_argument("--shard", type=name_list(SHARDS, "shard setting"), default=default("shard"),
                   help="ZeRO's sharded data parallelism in the scratch step (common/zero.py): none (the recipe: "
                        "everything replicated), optimizer (stage 1: each device keeps and updates its slice of the "
                        "optimizer state, then all-gathers the parameters), gradients (stage 2: a reduce-scatter in "
                        "place of the all-reduce), parameters (stage 3: each device keeps its slice of the parameters "
                        "too, all-gathered for the forward and backward and dropped after); comma-separated, a row "
                        "each")
    g.add_argument("--accumulate", type=int_list, default="1", metavar="K",
                   help="gradient accumulation: each device's shard of a --batch-size batch cut into K micro-batches, "
                        "their gradients added up on the device and all-reduced once per update (the scratch step and "
                        "the built-in engines, each its framework's way); comma-separated, a row each, e.g. 1,2,4")
    g.add_argument("--cores", type=name_list(CORES, "cores setting"), default=default("cores"),
                   help="shared (every op may use all of --threads) or per-device (each device pinned to cores "
                        "of its own: --threads / the most devices; see harness/processes/cores.py); comma-separated")
    g = p.add_argument_group("execution and timing")
    g.add_argument("--exec", type=name_list(EXEC_OPTIONS, "exec level"), default="default",
                   help="how the scratch step runs: default (the framework's usual way), eager, graph "
                        "(torch.compile, tf.function, hybridize, jax.jit), xla (tf.function+XLA)")
    g.add_argument("--layout", type=name_list(LAYOUT_OPTIONS, "layout"), default="default",
                   help="the scratch step's memory layout of images and conv kernels: default (the faster one "
                        "here: nhwc, MXNet's only nchw), nchw (channels first), nhwc (channels last)")
    g.add_argument("--precision", type=name_list(PRECISIONS, "precision"), default=default("precision"),
                   help="what the networks compute in: fp32, or bf16 or fp16 mixed precision (fp32 master weights, "
                        "convolutions and dense layers in bf16 or fp16, BatchNorm and the loss in fp32: "
                        "common/precision.py; fp16 with dynamic loss scaling: common/loss_scaling.py), each "
                        "framework's own way; comma-separated, a row each")
    g.add_argument("--allreduce-dtype", type=name_list(WIRE_DTYPES, "all-reduce dtype"),
                   default=default("allreduce_dtype"),
                   help="the gradients' precision on the wire: fp32, or bf16 (cast for the all-reduce, summed in "
                        "bf16, widened back: DDP's bf16_compress_hook); the scratch step, PyTorch's and JAX's "
                        "engines; comma-separated, a row each")
    g.add_argument("--loss-scale", type=float, default=default("loss_scale"),
                   help="fp16's initial loss scale, a power of two (PyTorch's default; Keras's is half of it)")
    g.add_argument("--loss-scale-interval", type=int, default=default("loss_scale_interval"), metavar="N",
                   help="fp16: the loss scale doubles after N steps in a row with finite gradients (and halves, the "
                        "step skipped, after one without)")
    g.add_argument("--threads", type=int, default=os.cpu_count(), help="threads per run: all cores")
    g.add_argument("--repeats", type=int, default=1, help="trials per row, interleaved; medians are reported")
    g.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped")
    g.add_argument("--stall-timeout", type=float, default=300,
                   help="seconds without a new training step (the first one included) before a run is "
                        "stopped as stalled")
    g.add_argument("--benchmark", action="store_true",
                   help="the timing benchmark: synthetic 30,000 images (the ResNet: 5,120), batch 256, every exec "
                        "mode, the idiomatic references, both --cores settings, bucketed across processes, 3 trials; "
                        "writes results/benchmark.{md,csv,json,png}")
    g.add_argument("--profile", metavar="DIR",
                   help="trace a few steady-state steps of every row with its framework's own profiler, into "
                        "DIR/<row> (a Chrome trace, or TensorBoard's profile plugin for TensorFlow; docs/profiling.md)")
    g = p.add_argument_group("outputs")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON (after every finished row)")
    g.add_argument("--csv", metavar="PATH", help="write the table as CSV (after every finished row)")
    g.add_argument("--plot", metavar="PATH", help="write loss curves and throughput bars as a PNG")
    g.add_argument("--resume", action="store_true",
                   help="continue the run that --json holds: keep its ok rows (same settings and data "
                        "required), run the others")
    g.add_argument("--list-devices", action="store_true", help="print the devices each framework sees; no training")
    g.add_argument("--merge", nargs="+", metavar="OUT_JSON",
                   help="no training: the table of hand-launched runs from their workers' out-{rank}.json files")
    g = p.add_argument_group("cluster and recovery")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save every run's trained model there, in its framework's native format, named "
                        "framework-mode-<devices>d-<processes>p-epoch<k> (.pt, .params, .weights.h5, .orbax)")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="with --checkpoint-dir: also every N epochs")
    g.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="start from a checkpoint saved after epoch k (its name says k) and train epochs k+1.. "
                        "--epochs in the batch order the uninterrupted run would see; one framework only")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --checkpoint-dir: when a process of a run dies, stop the run's others and start it "
                        "again from its last complete checkpoint, up to N times (torchrun's --max-restarts)")
    g.add_argument("--hosts", type=host_list, metavar="A,B,...",
                   help="spread each run's processes over these hosts (addresses or names; the first is the "
                        "coordinator): run the same command on every host, each with its own --node-rank")
    g.add_argument("--node-rank", type=int, default=0, help="with --hosts: this host's place in the list")
    g.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="with --hosts: the coordinator's port; TensorFlow's workers listen on the next ones")
    g.add_argument("--interface", help="with --hosts: this host's network interface (default: the one holding its "
                                       "address)")
    args = p.parse_args(argv)
    args.plan = grid(args)
    if args.benchmark:
        for key, value in BENCHMARK.items():
            setattr(args, key, value)
        args.plan = benchmark_plan(args.plan, args.model)
        args.devices = sorted({d for _, _, shapes, *_ in args.plan for d, _ in shapes})
        args.n_synthetic = BENCHMARK_IMAGES.get(args.model, args.n_synthetic)
        for ext in ("json", "csv", "plot"):
            setattr(args, ext, getattr(args, ext) or os.path.join("results", f"benchmark.{'png' if ext == 'plot' else ext}"))
    if args.epochs is None:
        args.epochs = default_epochs(args.dataset)
    if args.per_device_batch is not None:   # the largest row's, for the checks below
        args.batch_size = max(args.per_device_batch) * max(args.devices)
    for name in ("epochs", "batch_size", "threads", "n_synthetic", "repeats", "reference_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "timeout", "stall_timeout", "clip_norm"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        p.error("--target-accuracy must be in (0, 1]")
    if args.momentum is None:
        args.momentum = default_momentum(args.optimizer)
    if not 0 <= args.momentum < 1 or args.weight_decay < 0:
        p.error("--momentum must be in [0, 1) and --weight-decay >= 0")
    if args.optimizer != "rmsprop" and (args.rmsprop_centered or args.rmsprop_alpha != default("rmsprop_alpha")):
        p.error(f"--rmsprop-alpha and --rmsprop-centered are rmsprop's, not --optimizer {args.optimizer}'s")
    if not 0 < args.rmsprop_alpha < 1:
        p.error("--rmsprop-alpha must be in (0, 1)")
    if not 0 <= args.warmup_epochs <= args.epochs:
        p.error(f"--warmup-epochs must be between 0 and --epochs {args.epochs}")
    check_schedule(p, args)
    if args.resume and (args.merge or args.list_devices or not args.json):
        p.error("--resume continues a training run: it needs the --json PATH of that run "
                "(not --merge or --list-devices)")
    if args.batch_size < max(args.devices):
        p.error(f"--batch-size {args.batch_size} is smaller than {max(args.devices)} devices")
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or not args.checkpoint_dir):
        p.error("--checkpoint-every needs --checkpoint-dir and N >= 1")
    if args.max_restarts < 0 or (args.max_restarts and not args.checkpoint_dir):
        p.error("--max-restarts needs --checkpoint-dir (a restart starts from the last checkpoint) and N >= 0")
    args.cluster = cluster(p, args)
    check_model(p, args)
    if args.profile and args.benchmark:
        p.error("--profile adds the profiler's overhead to the rows: not with --benchmark")
    for name in ("data_dir", "checkpoint_dir", "resume_from", "profile"):   # the workers run from the repo root
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


# Each schedule's own options, and their defaults: given to another schedule, they would do nothing
SCHEDULE_OPTIONS = {"lr_decay_at": ("step",), "lr_decay_every": ("factor",), "lr_decay_factor": ("step", "factor"),
                    "lr_power": ("poly",), "lr_final": ("cosine",)}


def check_schedule(p, args):
    """The schedule's options go with their schedule, and make a schedule common.optim.Optimizer accepts."""
    for name, schedules in SCHEDULE_OPTIONS.items():
        if getattr(args, name) != default(name) and args.lr_schedule not in schedules:
            p.error(f"--{name.replace('_', '-')} is the {' and '.join(schedules)} schedule's, not "
                    f"--lr-schedule {args.lr_schedule}'s")
    if list(args.lr_decay_at) != sorted(set(args.lr_decay_at)) or any(
            not args.warmup_epochs <= e < args.epochs for e in args.lr_decay_at):
        p.error(f"--lr-decay-at: increasing epochs from the warm-up's end, before --epochs {args.epochs}")
    if args.lr_decay_every < 0 or not 0 < args.lr_decay_factor <= 1 or args.lr_power <= 0 or args.lr_final < 0:
        p.error("--lr-decay-every >= 0, --lr-decay-factor in (0, 1], --lr-power > 0, --lr-final >= 0")
    lowest = lowest_lr(args)
    if args.lr_final > lowest:
        p.error(f"--lr-final {args.lr_final:g} is above the rate the cosine decays from, {lowest:g}"
                + (" (the smallest global batch's, --lr-scaling linear)" if args.lr_scaling == "linear" else ""))


def lowest_lr(args):
    """The smallest rate a row starts its schedule from: --lr (or the optimizer's default), scaled at the smallest
    global batch under --lr-scaling linear (common.optim.scaled_lr)."""
    lr = args.lr if args.lr is not None else default_lr(args.model, args.optimizer)
    smallest = min(args.per_device_batch) * min(args.devices) if args.per_device_batch else args.batch_size
    return scaled_lr(lr, smallest, args.lr_scaling, args.reference_batch)


def check_model(p, args):
    """The ResNet's options (--width, --bn) and the init each network starts from: common.models.check's rules."""
    bn = None if args.model == "lenet" and args.bn == [default("bn")] else args.bn   # the default: not asked for
    try:
        check(args.model, args.width, args.init, bn)
    except RosettaError as err:
        p.error(str(err))
    if args.model == "lenet":
        args.bn = [None]


def cluster(p, args):
    """The hosts a run spans (harness/processes/cluster.py): this one alone unless --hosts names several."""
    if not args.hosts:
        if args.node_rank or args.interface or args.port != DEFAULT_PORT:
            p.error("--node-rank, --port and --interface go with --hosts")
        return ONE_HOST
    if args.benchmark or args.merge or args.list_devices:
        p.error("--hosts runs training: not with --benchmark, --merge or --list-devices")
    odd = [n for n in args.processes if n % len(args.hosts)]
    if odd:
        p.error(f"--hosts spreads each run's processes evenly over {len(args.hosts)} hosts: --processes "
                f"{odd[0]} is not a multiple of {len(args.hosts)}")
    if not 0 <= args.node_rank < len(args.hosts):
        p.error(f"--node-rank must be between 0 and {len(args.hosts) - 1}")
    if not 0 < args.port < 65536 - max(args.processes):
        p.error("--port must leave room for a port per process below 65536")
    try:
        return Cluster(tuple(args.hosts), args.node_rank, args.port, args.interface)
    except RosettaError as err:
        p.error(str(err))
