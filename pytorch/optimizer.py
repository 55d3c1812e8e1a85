"""The optimizer in PyTorch, twice: by hand for the scratch step (its state a list of buffers per slot, one replica's),
and as torch.optim's own classes and schedulers for the built-in and idiomatic modes. common/optim.py is PyTorch's
conventions, so the stock SGD, Adam, AdamW, RMSprop and Adagrad compute it as they are: no subclass."""
import sys
import typing
import warnings

import torch
from torch.optim import lr_scheduler

from common import lenet, resnet
from common.optim import CLIP_EPS


def init_state(replica, optimizer):
    """zeros_like keeps each parameter's device and strides: a conv kernel's buffers are channels-last too."""
    return {"optimizer": optimizer, "step": 0,
            **{slot: [torch.zeros_like(p) for p in replica] for slot in optimizer.slots}}


def state_to_numpy(state, model):
    """Each slot's buffers named and C-ordered as `model` (a Functional) does its replica's parameters."""
    arrays = {"step": state["step"]}
    for slot in state["optimizer"].slots:
        arrays.update({f"{slot}.{name}": value for name, value in model.to_numpy(state[slot]).items()})
    return arrays


def state_from_numpy(arrays, replica, optimizer, model):
    state = init_state(replica, optimizer)
    state["step"] = int(arrays["step"])
    for slot in optimizer.slots:
        for buffer, name in zip(state[slot], model.param_names):
            buffer.copy_(torch.from_numpy(arrays[f"{slot}.{name}"]))   # copy_ keeps the buffer's strides
    return state


def state_bytes(state):
    """The bytes of every slot's buffers, a whole state's or a sharded one's slices (what ZeRO's stage 1 saves)."""
    return sum(b.numel() * b.element_size() for slot in state["optimizer"].slots for b in state[slot])


def apply(params, grads, state, lr, batch_size, norm=None):
    """common/optim.py's update of one replica, in place, by hand: the gradients are the all-reduced sums, the same
    on every replica, so every replica clips by the same global norm and stays equal to the others. What
    torch.optim.SGD, Adam, AdamW, RMSprop and Adagrad (get_trainer) compute, written out, RMSprop's and Adagrad's in
    their single-tensor implementations' order of operations (the same rounding). Element-wise but for clipping, so
    it updates a sharded state's flat slices as they are: `norm` (a 0-d tensor) is then the mean gradient's global
    norm over every device's slices, which this device's own slices cannot give (None: computed from `grads`)."""
    o, t = state["optimizer"], state["step"]
    with torch.no_grad():
        grads = [g / batch_size for g in grads]   # the global batch's mean
        if o.clip_norm is not None:               # clip_grad_norm_'s: times clip / (norm + 1e-6), at most 1
            if norm is None:
                norm = torch.sqrt(sum((g * g).sum() for g in grads))
            grads = [g * (o.clip_norm / (norm + CLIP_EPS)).clamp(max=1.0) for g in grads]
        for i, (p, g) in enumerate(zip(params, grads)):
            if o.weight_decay and not o.decoupled:
                g = g + o.weight_decay * p
            if o.name == "sgd":
                p -= lr * g
            elif o.name in ("momentum", "nesterov"):
                v = state["momentum_buffer"][i]
                v.mul_(o.momentum).add_(g)        # the rate stays outside the buffer; v = g on the first step
                p -= lr * (g + o.momentum * v if o.name == "nesterov" else v)
            elif o.name == "rmsprop":
                s = state["square_avg"][i]
                s.mul_(o.alpha).addcmul_(g, g, value=1 - o.alpha)
                if o.centered:                    # the gradients' running variance: s - c^2
                    c = state["grad_avg"][i]
                    c.lerp_(g, 1 - o.alpha)       # a * c + (1 - a) * g
                    d = s.addcmul(c, c, value=-1).sqrt_().add_(o.eps)
                else:
                    d = s.sqrt().add_(o.eps)      # eps outside the square root
                if o.momentum:
                    v = state["momentum_buffer"][i]
                    v.mul_(o.momentum).addcdiv_(g, d)   # from v = 0; the rate stays outside the buffer
                    p.add_(v, alpha=-lr)
                else:
                    p.addcdiv_(g, d, value=-lr)
            elif o.name == "adagrad":
                s = state["sum"][i]
                s.addcmul_(g, g)
                p.addcdiv_(g, s.sqrt().add_(o.eps), value=-lr)
            else:
                if o.decoupled:
                    p.mul_(1 - lr * o.weight_decay)
                b1, b2 = o.betas
                m, s = state["exp_avg"][i], state["exp_avg_sq"][i]
                m.mul_(b1).add_(g, alpha=1 - b1)
                s.mul_(b2).addcmul_(g, g, value=1 - b2)
                p -= lr / (1 - b1 ** (t + 1)) * m / ((s / (1 - b2 ** (t + 1))).sqrt() + o.eps)   # eps outside sqrt
    state["step"] = t + 1


class Trainer(typing.NamedTuple):
    """What a PyTorch user holds beside the model: the optimizer, its learning-rate scheduler and the clipping norm
    (None: no clipping). step() is the three lines after loss.backward() in PyTorch's examples. `names`: the
    canonical names of the optimizer's parameters, in its order (the network's PARAM_NAMES), for the canonical state."""
    optimizer: torch.optim.Optimizer
    scheduler: lr_scheduler.LRScheduler
    clip_norm: float | None
    names: tuple | None = None

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self, scaler=None, to_mean=1.0):
        """The lines after loss.backward() in PyTorch's examples, with a torch.amp.GradScaler its AMP recipe's: the
        gradients as backward left them (under DistributedDataParallel, already all-reduced) unscaled
        (scaler.unscale_, before anything reads them) and times `to_mean` (to the global batch's mean: the engines
        differentiate summed losses), clipped, the update (through the scaler, which skips it when a gradient is not
        finite) and the scale's update; then the schedule moves to the next step's rate, only after an update that
        ran: its count is the updates', as Adam's step count is (the canonical state has one step for both).
        Returns whether the update ran."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if scaler is not None:
            scaler.unscale_(self.optimizer)   # a no-op when the scaler is disabled
        if to_mean != 1.0:
            for p in params:
                p.grad.mul_(to_mean)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
        if scaler is None:
            self.optimizer.step()
        else:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            if scaler.get_scale() < scale:   # backed off: the scaler found a gradient not finite and skipped the step
                return False
        self.scheduler.step()
        return True

    def state_dict(self):
        """What PyTorch's "saving and loading a general checkpoint" saves beside the model: the optimizer's
        state_dict (its buffers by parameter number, in the model's parameters() order, which is `names`'; every
        class but SGD counts the steps per parameter) and the scheduler's (its last_epoch is the steps done: SGD
        counts none)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load(self, state):
        """Put the canonical `state` into this new trainer, so that its next update is step state["step"] of the run.
        The buffers go in through the optimizer's load_state_dict as they are, in their parameter's layout (its
        strides: a channels-last kernel's buffer is channels-last, as torch.optim's own are, so the update runs the
        same kernels; a buffer of the wrong shape is saved as given, for the harness's read_state to name); every
        class but SGD also counts the steps per parameter (Adam's and AdamW's bias corrections; RMSprop and Adagrad
        count them, and a state of theirs without one does not step). A parameter with no buffers (a state before the
        first update) gets none, not even a count: torch.optim makes them at the first step, as it would (SGD's
        momentum, RMSprop's buffers, Adagrad's sum at its initial_accumulator_value, 0). The scheduler is stepped to
        the state's step, as the interrupted run stepped it: the warm-up's and the cosine's rates are each computed
        from the previous one, so only the same steps give the same rates, bit for bit."""
        optimizer, step = self.optimizer, state["step"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.names is None:
            raise ValueError(f"a state for {len(params)} parameters with no names (get_trainer's names)")
        slots = sorted({key.split(".", 1)[0] for key in state if key != "step"})
        # torch.optim.Optimizer's own packing (the groups, their parameters by number): a ZeroRedundancyOptimizer's
        # state_dict() needs a consolidation first, a collective, and packs the same groups
        saved = torch.optim.Optimizer.state_dict(optimizer)
        saved["state"] = {}
        for i, (p, name) in enumerate(zip(params, self.names)):
            buffers = {slot: buffer_like(p, state[f"{slot}.{name}"]) for slot in slots}
            if buffers and not isinstance(optimizer, torch.optim.SGD):
                buffers["step"] = torch.tensor(float(step))   # torch.optim's own form: a float32 tensor on the CPU
            saved["state"][i] = buffers
        optimizer.load_state_dict(saved)
        with warnings.catch_warnings():   # no update between these scheduler steps: that is the point here
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
            for _ in range(step):
                self.scheduler.step()


def buffer_like(p, array):
    """The canonical array as a buffer of parameter p: on its device, with its strides (empty_like keeps a dense
    tensor's); an array of another shape as it is. FSDP2's parameter is a DTensor (its shape the whole one's): the
    buffer is then this rank's shard of the array, placed as the parameter is (every rank holds the whole array, so
    distribute_tensor takes its own chunk, with no collective: src_data_rank None)."""
    t = torch.tensor(array, device=p.device)
    if t.shape != p.shape:
        return t
    # torch.distributed.tensor and .optim take 1.3 s to import, a third of a scratch worker's start: they are imported
    # where a sharded run uses them (builtin.py, for its engines), and a DTensor exists only once they are
    dtensors = sys.modules.get("torch.distributed.tensor")
    if dtensors is not None and isinstance(p, dtensors.DTensor):
        return dtensors.distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
    return torch.empty_like(p, requires_grad=False).copy_(t)


def get_schedule(torch_optimizer, optimizer):
    """common/optim.py's rates from torch's stock schedulers, one scheduler.step() after each update. LinearLR's
    factor is (t + 1) / W at step t < W; at step W, SequentialLR starts the schedule of the remaining D steps at its
    own step 0, so MultiStepLR counts its milestones from there. T_max is at least 1: when the warm-up is the whole
    run, the scheduler.step() after the last update still starts the cosine (cos(pi * 0 / 0) otherwise)."""
    o, warmup = optimizer, optimizer.warmup_steps
    if o.schedule == "cosine":
        after = lr_scheduler.CosineAnnealingLR(torch_optimizer, T_max=max(o.decay_steps, 1), eta_min=o.final_lr)
    elif o.schedule == "step":
        after = lr_scheduler.MultiStepLR(torch_optimizer, [m - warmup for m in o.milestones], gamma=o.decay_factor)
    elif o.schedule == "factor":
        after = lr_scheduler.StepLR(torch_optimizer, step_size=o.period, gamma=o.decay_factor)
    elif o.schedule == "poly":
        after = lr_scheduler.PolynomialLR(torch_optimizer, total_iters=max(o.decay_steps, 1), power=o.power)
    else:
        after = lr_scheduler.ConstantLR(torch_optimizer, factor=1.0)   # the rate as it is
    if not warmup:
        return after
    linear = lr_scheduler.LinearLR(torch_optimizer, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return lr_scheduler.SequentialLR(torch_optimizer, [linear, after], milestones=[warmup])


def get_trainer(parameters, optimizer, state=None, names=None, zero=False):
    """torch.optim's own classes with the spec's hyperparameters and its defaults for the rest (dampening 0, no
    amsgrad, no lr_decay): plain sgd is SGD without momentum; weight_decay is L2 in the gradient, except in AdamW, on
    every parameter (one group: BatchNorm's weight and bias and every bias too, torch.optim's default). `names`: the
    parameters' canonical names in their order (the network's PARAM_NAMES), which the canonical state needs (None:
    the LeNet's or the ResNet's, by their number). With a canonical `state` (a checkpoint's), the trainer goes on from
    it (Trainer.load). `zero` (--shard optimizer): torch.distributed.optim.ZeroRedundancyOptimizer, which takes the
    class and its hyperparameters, wraps it and keeps each rank's share of the state alone."""
    o, parameters = optimizer, list(parameters)
    if o.name in ("sgd", "momentum", "nesterov"):
        torch_class, hyper = torch.optim.SGD, dict(lr=o.lr, momentum=0.0 if o.name == "sgd" else o.momentum,
                                                   nesterov=o.name == "nesterov", weight_decay=o.weight_decay)
    elif o.name == "rmsprop":
        torch_class, hyper = torch.optim.RMSprop, dict(lr=o.lr, alpha=o.alpha, eps=o.eps, weight_decay=o.weight_decay,
                                                       momentum=o.momentum, centered=o.centered)
    elif o.name == "adagrad":   # Adagrad's own eps is 1e-10; its sum starts at 0 and its rate does not decay
        torch_class, hyper = torch.optim.Adagrad, dict(lr=o.lr, eps=o.eps, weight_decay=o.weight_decay,
                                                       initial_accumulator_value=0.0)
    else:
        torch_class = torch.optim.AdamW if o.decoupled else torch.optim.Adam
        hyper = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        torch_optimizer = ZeroRedundancyOptimizer(parameters, torch_class, **hyper)
    else:
        torch_optimizer = torch_class(parameters, **hyper)
    names = NAMES_BY_COUNT.get(len(parameters)) if names is None else tuple(names)
    trainer = Trainer(torch_optimizer, get_schedule(torch_optimizer, o), o.clip_norm, names)
    if state is not None:
        trainer.load(state)
    return trainer


# The networks' parameter names by their number: a file of torch.optim's state numbers its parameters, no more
NAMES_BY_COUNT = {len(names): names for names in (lenet.PARAM_NAMES, resnet.PARAM_NAMES)}


def canonical_state(saved, names=None):
    """The canonical state (common.optim.init_state's form) in a Trainer.state_dict(), its arrays as stored but
    C-ordered copies: a channels-last buffer's numpy view keeps its strides, and a view of a live buffer would
    change under its caller with the next update. The step counts (every class's but SGD's) must be the scheduler's.
    `names`: the parameters' canonical names in the optimizer's order; None: the LeNet's or the ResNet's, whichever
    network has as many parameters as the optimizer (the ResNet has as many at every width)."""
    if not isinstance(saved, dict) or set(saved) != {"optimizer", "scheduler"}:   # e.g. a model's weights
        raise ValueError("not an optimizer and scheduler checkpoint (Trainer.state_dict)")
    step, buffers = saved["scheduler"]["last_epoch"], saved["optimizer"]["state"]
    if names is None:
        count = sum(len(group["params"]) for group in saved["optimizer"]["param_groups"])
        if count not in NAMES_BY_COUNT:
            raise ValueError(f"state for {count} parameters; the LeNet has {len(lenet.PARAM_NAMES)}, the ResNet "
                             f"{len(resnet.PARAM_NAMES)}")
        names = NAMES_BY_COUNT[count]
    if set(buffers) - set(range(len(names))):
        raise ValueError(f"state for {len(buffers)} parameters; this network has {len(names)}")
    state = {"step": step}
    for i, name in enumerate(names):
        for slot, value in buffers.get(i, {}).items():
            if slot == "step":
                if float(value) != step:
                    raise ValueError(f"{name}'s step count is {float(value):g}, the scheduler's {step}")
            else:
                state[f"{slot}.{name}"] = value.detach().cpu().numpy().copy()
    return state
