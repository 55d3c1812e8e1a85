"""Train the same LeNet, data-parallel, in every framework on identical data and compare.

    python compare.py                          # all frameworks, digits, 2 devices
    python compare.py --dataset fashion-mnist  # the recipe's data set (see docs/usage.md)
    python compare.py --mode scratch,builtin --processes 1,2   # the frameworks' own engines too
    python compare.py --benchmark              # the timing table: table, CSV, JSON and PNG
    python compare.py --list-devices           # what each framework sees
    python compare.py --merge out-*.json       # the table of a hand-launched run (torchrun, TF_CONFIG, DMLC_*)

Read top to bottom: parse the options, plan the rows (harness/plan.py), run each in its own worker processes
(harness/worker.py: thread counts fixed before the framework is imported, a framework that crashes or is
missing costs only its own row), report. The requested files are rewritten after every finished trial, so an
interrupted run keeps its finished rows (--resume goes on).
"""
import os
import signal
import sys
import time

from common.buckets import ALLREDUCES, BUCKET_MB
from common.data import DATASETS, load_dataset
from common.interface import FRAMEWORKS, RosettaError
from common.lenet import INITS
from common.models import BN_MODES, DEFAULT_WIDTH, MODELS, RESNET_SGD_LR
from common.optim import DEFAULT_LR, LR_SCALINGS, OPTIMIZERS, SCHEDULES
from harness.benchmark import add_scaling
from harness.calibration import LoadRecord, machine_lockstep, matmul_peak, warning
from harness.checkpoints import check_resume, epoch_of, latest_checkpoint
from harness.cli import HelpFormatter, Parser, host_list, int_list, name_list
from harness.cluster import DEFAULT_PORT, ONE_HOST, Cluster
from harness.cores import CORES
from harness.launch import raise_on_signals, run_workers
from harness.merge import merge_files, merge_records
from harness.outputs import check_outputs, output_paths, write_files, write_results
from harness.plan import BENCHMARK, BENCHMARK_IMAGES, EXEC_OPTIONS, LAYOUT_OPTIONS, benchmark_plan, check_data, grid, \
    row_label, run_specs
from harness.profile import trace_folder
from harness.report import add_parity, environment, environment_line, format_scaling, format_table, optimizer_line, \
    progress_bar, timing_view
from harness.resume import check_same_data, kept_trials, previous_run
from harness.spec import default, default_epochs
from harness.split import allreduce_alone, alongside, format_split
from harness.training import MODES


def parse_args(argv):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--frameworks", type=name_list(FRAMEWORKS, "framework"), default=",".join(FRAMEWORKS),
                   help="comma-separated")
    p.add_argument("--model", choices=tuple(MODELS), default=default("model"),
                   help="the network: the recipe's LeNet, or d2l's ResNet-18 with BatchNorm (common/models.py)")
    p.add_argument("--width", type=int, help=f"the ResNet's channels in its first stage (default {DEFAULT_WIDTH}; "
                                             "d2l's is 64)")
    p.add_argument("--bn", type=name_list(BN_MODES, "BatchNorm mode"), default=default("bn"),
                   help="the ResNet's BatchNorm across replicas: local (each normalises by its shard's statistics), "
                        "sync (by the global batch's, all-reduced across devices and processes); comma-separated")
    p.add_argument("--mode", type=name_list(tuple(MODES), "mode"), default=default("mode"),
                   help="scratch (the recipe), builtin (the framework's own engine), "
                        "idiomatic (its minimal single-device loop, the timing reference)")
    p.add_argument("--exec", type=name_list(EXEC_OPTIONS, "exec level"), default="default",
                   help="how the scratch step runs: default (the framework's usual way), eager, graph "
                        "(torch.compile, tf.function, hybridize, jax.jit), xla (tf.function+XLA)")
    p.add_argument("--layout", type=name_list(LAYOUT_OPTIONS, "layout"), default="default",
                   help="the scratch step's memory layout of images and conv kernels: default (the faster one "
                        "here: nhwc, MXNet's only nchw), nchw (channels first), nhwc (channels last)")
    p.add_argument("--allreduce", type=name_list(ALLREDUCES, "all-reduce"), default=default("allreduce"),
                   help="how the scratch step sums the gradients across devices and processes: per-tensor (the "
                        "recipe: one all-reduce per parameter) or bucketed (DDP's way: flattened into buckets of "
                        f"{BUCKET_MB} MiB, one all-reduce each; common/buckets.py); also JAX's built-in step, whose "
                        "psum is written by hand (the others sum their own way); comma-separated")
    p.add_argument("--devices", type=int_list, default="2", help="device counts, e.g. 1,2")
    p.add_argument("--processes", type=int_list, default="1",
                   help="process counts, e.g. 1,2: the devices are shared out among them")
    p.add_argument("--cores", type=name_list(CORES, "cores setting"), default=default("cores"),
                   help="shared (every op may use all of --threads) or per-device (each device pinned to cores "
                        "of its own: --threads / the most devices; see harness/cores.py); comma-separated")
    p.add_argument("--dataset", choices=DATASETS, default=default("dataset"), help="the data set (see docs/usage.md)")
    p.add_argument("--data-dir", help="folder with the IDX files (fashion-mnist, mnist)")
    p.add_argument("--n-synthetic", type=int, default=default("n_synthetic"), help="training images of the synthetic set")
    p.add_argument("--epochs", type=int, help="default 30 for digits, 10 otherwise")
    p.add_argument("--batch-size", type=int, default=default("batch_size"), help="global batch, split across devices")
    p.add_argument("--per-device-batch", type=int_list, metavar="N",
                   help="instead of --batch-size: each row's global batch is N x its devices (weak scaling); "
                        "comma-separated, a row per N")
    p.add_argument("--lr", type=float, help="the base learning rate; default by --optimizer: "
                   + ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())
                   + "; " + ", ".join(f"{model}'s sgd {lr:g}" for model, lr in RESNET_SGD_LR.items()))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=default("optimizer"),
                   help="the update, PyTorch's conventions in every framework (common/optim.py)")
    p.add_argument("--momentum", type=float, default=default("momentum"), help="momentum and nesterov's")
    p.add_argument("--weight-decay", type=float, default=default("weight_decay"),
                   help="L2 added to the gradient; decoupled (w -= lr * wd * w) for adamw")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default=default("lr_schedule"),
                   help="per step: constant, step (x0.1 at 1/2 and 3/4 of the steps after warm-up), cosine (to 0)")
    p.add_argument("--warmup-epochs", type=float, default=default("warmup_epochs"),
                   help="linear warm-up, per step, from lr / warm-up steps to lr")
    p.add_argument("--clip-norm", type=float, help="clip the all-reduced mean gradient to this global norm")
    p.add_argument("--lr-scaling", choices=LR_SCALINGS, default=default("lr_scaling"),
                   help="linear: lr times global batch / --reference-batch (the linear scaling rule)")
    p.add_argument("--reference-batch", type=int, default=default("reference_batch"),
                   help="the global batch --lr is meant for, with --lr-scaling linear")
    p.add_argument("--target-accuracy", type=float, metavar="A",
                   help="evaluate after every epoch (outside the timers) and report the training seconds until the "
                        "test accuracy first reached A (time to accuracy, e.g. 0.85 on fashion-mnist)")
    p.add_argument("--seed", type=int, default=default("seed"), help="initial weights and batch order")
    p.add_argument("--init", choices=INITS, default=default("init"), help="he, or the recipe's normal(0, 0.01)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads per run: all cores")
    p.add_argument("--repeats", type=int, default=1, help="trials per row, interleaved; medians are reported")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped")
    p.add_argument("--stall-timeout", type=float, default=300,
                   help="seconds without a new training step (the first one included) before a run is "
                        "stopped as stalled")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (after every finished row)")
    p.add_argument("--csv", metavar="PATH", help="write the table as CSV (after every finished row)")
    p.add_argument("--plot", metavar="PATH", help="write loss curves and throughput bars as a PNG")
    p.add_argument("--resume", action="store_true",
                   help="continue the run that --json holds: keep its ok rows (same settings and data "
                        "required), run the others")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save every run's trained model there, in its framework's native format, named "
                        "framework-mode-<devices>d-<processes>p-epoch<k> (.pt, .params, .weights.h5, .orbax)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="with --checkpoint-dir: also every N epochs")
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="start from a checkpoint saved after epoch k (its name says k) and train epochs k+1.. "
                        "--epochs in the batch order the uninterrupted run would see; one framework only")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --checkpoint-dir: when a process of a run dies, stop the run's others and start it "
                        "again from its last complete checkpoint, up to N times (torchrun's --max-restarts)")
    p.add_argument("--hosts", type=host_list, metavar="A,B,...",
                   help="spread each run's processes over these hosts (addresses or names; the first is the "
                        "coordinator): run the same command on every host, each with its own --node-rank")
    p.add_argument("--node-rank", type=int, default=0, help="with --hosts: this host's place in the list")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="with --hosts: the coordinator's port; TensorFlow's workers listen on the next ones")
    p.add_argument("--interface", help="with --hosts: this host's network interface (default: the one holding its "
                                       "address)")
    p.add_argument("--profile", metavar="DIR",
                   help="trace a few steady-state steps of every row with its framework's own profiler, into "
                        "DIR/<row> (a Chrome trace, or TensorBoard's profile plugin for TensorFlow; docs/profiling.md)")
    p.add_argument("--benchmark", action="store_true",
                   help="the timing benchmark: synthetic 30,000 images (the ResNet: 5,120), batch 256, every exec "
                        "mode, the idiomatic references, both --cores settings, bucketed across processes, 3 trials; "
                        "writes results/benchmark.{md,csv,json,png}")
    p.add_argument("--list-devices", action="store_true", help="print the devices each framework sees; no training")
    p.add_argument("--merge", nargs="+", metavar="OUT_JSON",
                   help="no training: the table of hand-launched runs from their workers' out-{rank}.json files")
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
    if not 0 <= args.momentum < 1 or args.weight_decay < 0:
        p.error("--momentum must be in [0, 1) and --weight-decay >= 0")
    if not 0 <= args.warmup_epochs <= args.epochs:
        p.error(f"--warmup-epochs must be between 0 and --epochs {args.epochs}")
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


def check_model(p, args):
    """What the ResNet takes beyond the LeNet's options (--width, --bn), and what it does not take yet."""
    if args.model == "lenet":
        if args.width is not None or args.bn != [default("bn")]:
            p.error("--width and --bn are the ResNet's (--model resnet18); the LeNet has neither")
        args.bn = [None]
        return
    if args.width is not None and args.width < 1:
        p.error("--width must be >= 1")
    if args.init != "he":
        p.error("--init recipe is the LeNet's normal(0, 0.01); the ResNet starts from He-normal weights")
    if args.optimizer != "sgd" or args.weight_decay or args.clip_norm:
        p.error("the ResNet trains with plain SGD (--lr-schedule and --warmup-epochs work; momentum, Adam, weight "
                "decay and clipping are the LeNet's so far: issue 19)")


def cluster(p, args):
    """The hosts a run spans (harness/cluster.py): this one alone unless --hosts names several."""
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
    if timing:   # this machine's yardsticks, measured in the run (harness/calibration.py)
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
    """The table of hand-launched runs (torchrun, TF_CONFIG, DMLC_*, JAX_*): one row per run (harness/merge.py)."""
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
        print(f"\nWhere each step of several devices goes (harness/split.py):\n{format_split(runs)}")
    if args.plot:
        from harness.plots import plot_runs
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
    except KeyboardInterrupt as err:   # Ctrl-C, SIGTERM, SIGHUP (harness.launch.Interrupted)
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
