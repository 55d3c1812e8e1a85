"""One run, named once: every field a run has and its default. compare.py plans runs of this type, the launcher
starts workers with it, a worker reads it back from JSON, --merge and --resume compare them. A hand-launched
worker's JSON may give only some fields (docs/usage.md: "Multi-process runs by hand"); the rest take these defaults."""
import dataclasses
import json

from common.buckets import ALLREDUCES
from common.data import SYNTHETIC_SIZE
from common.interface import RosettaError
from common.models import DEFAULT_WIDTH, RESNET_SGD_LR, check, check_bn, has_batchnorm
from common.optim import DEFAULT_LR, REFERENCE_BATCH, STEP_FACTOR, Optimizer, default_momentum, scaled_lr
from common.loss_scaling import check as check_loss_scaling
from common.precision import check as check_precision, check_wire
from common.zero import SHARDS

DEFAULT_EPOCHS = {"digits": 30}   # small data: few steps per epoch; the recipe's 10 elsewhere
# The schedules' own parameters (common.optim.Optimizer's, in epochs where it counts steps)
SCHEDULE_FIELDS = ("lr_decay_at", "lr_decay_every", "lr_decay_factor", "lr_power", "lr_final")
RMSPROP_FIELDS = ("rmsprop_alpha", "rmsprop_centered")   # rmsprop's own (Optimizer's alpha and centered)
# The fields that make a row of the table what it is (the rest say where the data and files are).
ROW_FIELDS = ("framework", "model", "width", "bn", "mode", "exec", "layout", "allreduce", "shard", "accumulate", "precision",
              "allreduce_dtype", "loss_scale", "loss_scale_interval", "devices", "processes", "cores", "epochs",
              "batch_size", "lr", "seed", "init", "threads", "optimizer", "momentum", *RMSPROP_FIELDS, "weight_decay",
              "lr_schedule",
              "warmup_epochs", *SCHEDULE_FIELDS, "clip_norm", "lr_scaling", "reference_batch", "target_accuracy")


def default_epochs(dataset):
    return DEFAULT_EPOCHS.get(dataset, 10)


def default_lr(model, optimizer):
    """common.optim.DEFAULT_LR, but d2l's 0.1 for the ResNet's plain SGD at batch 256 (its concise multi-GPU chapter)."""
    if optimizer == "sgd" and model in RESNET_SGD_LR:
        return RESNET_SGD_LR[model]
    return DEFAULT_LR.get(optimizer, DEFAULT_LR["sgd"])


def default(field):
    """A field's default, for the command line's options (their --help shows it)."""
    return next(f.default for f in dataclasses.fields(RunSpec) if f.name == field)


# The settings a row may change from the recipe's step, as a row's label says them (", bucketed, bf16"), in one order.
VARIANTS = (("allreduce", "{}"), ("shard", "{} sharded"), ("accumulate", "accumulate {}"), ("precision", "{}"),
            ("allreduce_dtype", "{} all-reduce"))


def variant(row):
    """What `row` (a RunSpec, or a result's mapping, whose missing or None fields are the defaults) changes from the
    recipe's step: the words its label and its plot's bar add, so two rows that differ only there are told apart."""
    value = row.get if isinstance(row, dict) else lambda field: getattr(row, field)
    return "".join(f", {text.format(value(field))}" for field, text in VARIANTS
                   if value(field) not in (None, default(field)))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    framework: str
    model: str = "lenet"             # lenet | resnet18 (common/models.py)
    width: int | None = None         # the ResNet's width (None: common.models.DEFAULT_WIDTH); None for the LeNet
    bn: str | None = "local"         # the ResNet's BatchNorm: local (each replica its shard's) | sync; None: LeNet
    mode: str = "scratch"            # scratch | builtin | idiomatic (harness/training/loop.py MODES)
    exec: str = "default"            # the scratch step's exec level (each execution.py's LEVELS)
    layout: str = "default"          # the scratch step's memory layout (each execution.py's LAYOUTS)
    allreduce: str = "per-tensor"    # the scratch step's sum of the gradients: per-tensor | bucketed (common/buckets.py)
    shard: str = "none"              # the scratch step's ZeRO stage: none | optimizer | gradients (common/zero.py)
    accumulate: int = 1              # the scratch step's micro-batches per device's shard, one all-reduce per update
    precision: str = "fp32"          # fp32 | bf16 | fp16: the compute, fp32 master weights (common/precision.py)
    allreduce_dtype: str = "fp32"    # fp32 | bf16: the gradients' precision on the wire (common/precision.py)
    loss_scale: float = 2.0 ** 16    # fp16's dynamic loss scaling: the initial scale (common/loss_scaling.py)
    loss_scale_interval: int = 2000  # ... and the finite steps after which it doubles
    devices: int = 1                 # in all, over every process
    processes: int = 1
    cores: str = "shared"            # shared | per-device (harness/processes/cores.py)
    threads: int | None = None       # per process; None: every core
    dataset: str = "digits"
    data_dir: str | None = None
    n_synthetic: int = SYNTHETIC_SIZE   # training images of the synthetic set
    epochs: int | None = None        # None: DEFAULT_EPOCHS for the data set, else 10
    batch_size: int = 256            # global, split across processes and devices
    lr: float | None = None          # the base rate; None: common.optim.DEFAULT_LR for the optimizer (0.2 for sgd)
    optimizer: str = "sgd"           # sgd | momentum | nesterov | adam | adamw | rmsprop | adagrad (common/optim.py)
    momentum: float | None = None    # momentum, nesterov and rmsprop; None: common.optim.default_momentum's
    rmsprop_alpha: float = 0.99      # rmsprop: the squares' running average keeps this much
    rmsprop_centered: bool = False   # rmsprop: divided by the gradients' running variance
    weight_decay: float = 0.0        # L2 in the gradient; decoupled for adamw
    lr_schedule: str = "constant"    # constant | step | cosine | factor | poly, per step (common/optim.py)
    warmup_epochs: float = 0.0       # linear warm-up, per step, before the schedule
    lr_decay_at: tuple = ()          # step: its milestones in epochs from the start (none: 1/2 and 3/4 after warm-up)
    lr_decay_every: float = 0.0      # factor: a decay every this many epochs after the warm-up (0: a quarter of them)
    lr_decay_factor: float = STEP_FACTOR   # step, factor: the rate's multiplier at each decay
    lr_power: float = 2.0            # poly
    lr_final: float = 0.0            # cosine: the rate it ends at
    clip_norm: float | None = None   # clip the all-reduced mean gradient to this global norm
    lr_scaling: str = "none"         # none | linear: lr * global batch / reference_batch
    reference_batch: int = REFERENCE_BATCH
    target_accuracy: float | None = None   # test accuracy after every epoch, and the seconds to reach this one
    seed: int = 0                    # initial weights and batch order
    init: str = "he"                 # he | recipe (common/lenet.py)
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume_from: str | None = None
    profile: str | None = None       # a folder for the trace of a few steps by the framework's profiler (harness/training/profile.py)
    task: str = "train"              # train | devices | feed (tests) | step, allreduce (harness/studies/projection.py) | expert | collectives (harness/studies/split.py)
    max_steps: int | None = None     # stop early (parity tests)
    weights_out: str | None = None   # .npz of the final weights, rank 0 (parity tests)
    weights_trace: str | None = None  # .npz of the weights before every step and at the end, rank 0 (optimizer tests)
    bytes: int | None = None         # task allreduce: the buffer's size
    repeats: int | None = None       # tasks step and allreduce: timed repeats

    def __post_init__(self):
        if self.epochs is None:
            object.__setattr__(self, "epochs", default_epochs(self.dataset))
        object.__setattr__(self, "lr_decay_at", tuple(self.lr_decay_at))   # JSON gives a list; a spec is hashed
        if self.lr is None:
            object.__setattr__(self, "lr", default_lr(self.model, self.optimizer))
        if self.momentum is None:
            object.__setattr__(self, "momentum", default_momentum(self.optimizer))
        check(self.model, self.width if has_batchnorm(self.model) else None, self.init)
        check_bn(self.model, self.bn)
        check_precision(self.precision)
        check_wire(self.allreduce_dtype)
        if self.shard not in SHARDS:
            raise RosettaError(f"unknown shard setting {self.shard!r}; choose from {', '.join(SHARDS)}")
        check_loss_scaling(self.loss_scale, self.loss_scale_interval)
        if self.allreduce not in ALLREDUCES:
            raise RosettaError(f"unknown all-reduce {self.allreduce!r}; choose from {', '.join(ALLREDUCES)}")
        if has_batchnorm(self.model):
            object.__setattr__(self, "width", self.width or DEFAULT_WIDTH)
        else:   # the LeNet has neither: a hand-written spec may leave them out or give the defaults
            object.__setattr__(self, "width", None)
            object.__setattr__(self, "bn", None)

    def canonical_optimizer(self, steps_per_epoch):
        """The update this run computes (common/optim.py), its schedule as long as the run."""
        try:
            lr = scaled_lr(self.lr, self.batch_size, self.lr_scaling, self.reference_batch)
            return Optimizer(self.optimizer, lr, self.momentum, self.weight_decay, self.lr_schedule,
                             round(self.warmup_epochs * steps_per_epoch), self.epochs * steps_per_epoch, self.clip_norm,
                             decay_at=tuple(round(e * steps_per_epoch) for e in self.lr_decay_at),
                             decay_every=max(1, round(self.lr_decay_every * steps_per_epoch)) if self.lr_decay_every
                             else 0, decay_factor=self.lr_decay_factor, power=self.lr_power, final_lr=self.lr_final,
                             alpha=self.rmsprop_alpha, centered=self.rmsprop_centered)
        except ValueError as err:
            raise RosettaError(str(err)) from None

    @property
    def per_process(self):
        """The devices each process owns: a run's devices are shared out evenly (common/placement.py)."""
        return max(1, self.devices // self.processes)

    def row(self):
        """The fields a table row shows, as a dict."""
        return {k: getattr(self, k) for k in ROW_FIELDS}

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self):
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def of(cls, value):
        """A RunSpec from itself, a dict or JSON text; an unknown field is one clear error, not a silent typo."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise RosettaError(f"the run spec is not JSON ({err})") from None
        if not isinstance(value, dict) or "framework" not in value:
            raise RosettaError("a run spec is a JSON object with at least a \"framework\"")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise RosettaError(f"unknown run spec field(s) {', '.join(map(repr, unknown))}; "
                               f"known: {', '.join(sorted(names))}")
        return cls(**value)
