"""Convert a trained model (the LeNet, or a ResNet with its BatchNorm state) from one framework's native checkpoint to
another's, through the canonical layout.

    python -m harness.training.convert SRC DST [--from F] [--to F] [--optimizer NAME] [--verify] [--dataset digits]

The frameworks come from the names (.pt PyTorch, .params MXNet, .weights.h5 Keras, .orbax JAX) or from --from
and --to. The source is checked first (every parameter of the LeNet or of a ResNet, and a ResNet's running
statistics, with their shapes) and the destination is written completely or not at all. The optimizer state saved
beside SRC (a run with momentum, Adam or a schedule writes one) goes with it: its buffers through the same layout
changes as their weights and into the target's convention (MXNet's stock SGD and NAG keep the rate inside the momentum
buffer, torch.optim outside it), its step count as it is, written in the target framework's native way with the
optimizer's hyperparameters. fp16's loss scaler, kept beside it the same way in every framework, is copied across.
A PyTorch program's own checkpoint (one torch.save of the model's, the optimizer's and GradScaler's state_dicts, as
PyTorch's tutorials write it) gives all three.
Which optimizer wrote it: a Gluon Trainer's file names it (its pickled optimizer, rate, momentum, weight decay and
schedule, with the schedule's position); otherwise its buffers tell (momentum or adam), or --optimizer says
(nesterov, adamw), which also requires a state. --verify loads both files with
their frameworks' own calls into their idiomatic models, in inference mode (a ResNet normalises by its running
statistics), and prints the largest logit difference and both accuracies on the test split (and checks that the converted state reads back identical)."""
import argparse
import dataclasses
import math
import os
import sys

import numpy as np

from common.interface import FRAMEWORKS, RosettaError
from common.optim import OPTIMIZERS, Optimizer, epsilon_hat_gap, how_often, of_state, rate_changes

TOLERANCE = 1e-4   # float32 round-off of two frameworks' kernels on the same weights, with room to spare


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m harness.training.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a native checkpoint (file, or directory for Orbax)")
    p.add_argument("dst", help="where to write the other framework's checkpoint")
    p.add_argument("--from", dest="source", choices=FRAMEWORKS, help="SRC's framework (default: from its name)")
    p.add_argument("--to", dest="target", choices=FRAMEWORKS, help="DST's framework (default: from its name)")
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="the optimizer whose state SRC has beside it (default: told from its buffers); SRC must "
                        "have one")
    p.add_argument("--lr", type=float, metavar="LR",
                   help="the rate of SRC's last update, where SRC does not say it (this project's PyTorch, Keras and "
                        "Orbax files) and the target's stock optimizer keeps the rate inside its momentum buffer "
                        "(Keras's SGD and RMSprop, Optax's rmsprop, MXNet's SGD, NAG and centered RMSProp), which the file "
                        "must hold times it")
    p.add_argument("--state", metavar="PATH",
                   help="SRC's optimizer state where it is not beside SRC under SRC's name (a Gluon program's "
                        "trainer.states beside its net.params)")
    p.add_argument("--accept-gap", action="store_true",
                   help="convert an optimizer state that the target's stock optimizer continues only approximately "
                        "(MXNet's stock Adam; its cosine and polynomial schedules, one update ahead; its momentum "
                        "under a rate that still changes); a line says what differs and by how much")
    p.add_argument("--verify", action="store_true",
                   help=f"load both, compare logits on the test split (fails above {TOLERANCE:g})")
    p.add_argument("--dataset", default="digits", help="test split for --verify (default digits)")
    p.add_argument("--data-dir", help="folder with the IDX files (fashion-mnist, mnist)")
    p.error = lambda message: p.exit(2, f"error: {message} (see python -m harness.training.convert --help)\n")
    return p.parse_args(argv)


def verify(source, src, target, dst, data, width=None):
    """(largest |logit difference|, source accuracy, destination accuracy) on the test split; `width`: a ResNet's."""
    from .checkpoints import reason
    from ..loader import load_module
    logits = []
    for framework, path in ((source, src), (target, dst)):
        checkpoint = load_module(framework, "checkpoint")
        try:
            logits.append(checkpoint.logits(checkpoint.load(path, width), data.X_test))
        except Exception as err:   # the file passed the checks, so this is a bug here: say where
            raise RosettaError(f"{path}: {framework}'s own loading failed ({reason(err)})")
    accuracy = [float((out.argmax(1) == data.y_test).mean()) for out in logits]
    return float(abs(logits[0] - logits[1]).max()), *accuracy


def main(argv=None):
    args = parse_args(argv)
    from common.data import load_dataset

    from common.resnet import width_of

    from .checkpoints import (FORMATS, framework_of, has_state, not_carried, other_states, read_model, read_optimizer,
                              read_scaler, read_state, state_file, state_path, stock_checkpoint, write_scaler, write_state,
                              write_weights)
    written = False   # once DST is written, a failed --verify says so: the file stays, untrusted
    try:
        source = args.source or framework_of(args.src, "; give --from")
        target = args.target or framework_of(args.dst, "; give --to")
        data = load_dataset(args.dataset, args.data_dir) if args.verify else None   # bad data: fail before writing
        weights, bn_state = read_model(source, args.src)
        optimizer = Optimizer(args.optimizer) if args.optimizer else None
        given = args.state
        if given is not None and not has_state(source, args.src, given):
            raise RosettaError(f"{given}: {stock_checkpoint(source, given) or 'no such optimizer state (--state)'}")
        told, gap = read_optimizer(source, args.src, args.accept_gap, given)   # a file naming its optimizer is believed
        if told and optimizer and told.name != optimizer.name:
            raise RosettaError(f"{args.src}: its optimizer state is {told.name}'s, not {optimizer.name}'s")
        optimizer = told or optimizer
        state = read_state(source, args.src, optimizer, weights, given) \
            if optimizer or has_state(source, args.src, given) else None
        others = other_states(source, args.src) if state is None else []
        if others:
            print(f"note: no optimizer state under {os.path.basename(state_path(source, args.src))}, but "
                  f"{', '.join(others)} beside it: the weights alone are converted (--state PATH carries a state of "
                  "another name)", file=sys.stderr)
        left = not_carried(source, args.src)
        if left:
            beside = os.path.basename(state_path(source, args.src))
            carried = f"the state is {os.path.basename(state_file(source, args.src, given))}'s" if state is not None \
                else f"a state is carried from {beside} beside it, or --state PATH"
            print(f"note: {os.path.basename(args.src)} also holds {left}: not carried, the weights are converted "
                  f"({carried})", file=sys.stderr)
        scaler = read_scaler(source, args.src)   # fp16's loss scaler, kept the same way in every framework
        if gap:
            print(f"note: {gap}", file=sys.stderr)
        if state is not None:   # read and checked before anything is written
            optimizer = optimizer_of(state, optimizer)
            optimizer = with_rate(optimizer, told, args, target)
            write_state(target, state, optimizer, args.dst)
        if scaler is not None:
            write_scaler(target, *scaler, args.dst)
        write_weights(target, weights, args.dst, bn_state)
        written = True
        print(f"wrote {args.dst} ({FORMATS[target]}) from {args.src} ({FORMATS[source]})"
              + (f", with {optimizer.name}'s state after {state['step']} steps ({hyperparameters(optimizer)}) in "
                 f"{os.path.basename(state_path(target, args.dst))}" if state is not None else "")
              + (f", and its loss scaler (scale {scaler[0].scale:g}, {scaler[0].good_steps} finite steps towards its "
                 "growth)" if scaler is not None else ""))
        if state is not None and told is None and args.lr is None and target != "jax":   # torch.optim's, Gluon's and
            print(f"note: {os.path.basename(args.src)} gives no rate the converter reads: "  # Keras's states hold the
                  f"{os.path.basename(args.dst)}'s optimizer holds lr {optimizer.lr:g}, its default, which a stock "  # rate
                  "optimizer takes on loading; give --lr, the rate of its last update", file=sys.stderr)
        if state is not None and not gap:
            stock_note(target, optimizer, state, args.dst)
        if state is not None and args.verify:
            again = read_state(target, args.dst, optimizer, weights)
            if any(not np.array_equal(again[k], state[k]) for k in state):
                raise RosettaError(f"{args.dst}: its optimizer state does not read back as {args.src}'s")
        if args.verify:
            width = None if bn_state is None else width_of(weights)
            difference, src_accuracy, dst_accuracy = verify(source, args.src, target, args.dst, data, width)
            print(f"verify on {data.name} test ({len(data.y_test)} images): largest |logit difference| "
                  f"{difference:.2e}; accuracy {source} {src_accuracy:.4f}, {target} {dst_accuracy:.4f}")
            if not difference <= TOLERANCE:   # NaN too: logits that are not numbers prove no two files equal
                raise RosettaError(f"{args.dst}: logits differ from {args.src}'s by {difference:.2e} (> {TOLERANCE:g})"
                                   if np.isfinite(difference) else f"{args.dst}: its logits or {args.src}'s are not "
                                   "finite (NaN or inf: weights of a run that diverged?); --verify proves nothing")
    except RosettaError as err:
        print(f"error: {err}" + (f" ({args.dst} is written, but did not pass --verify: do not trust it)" if written
                                 and args.verify else ""), file=sys.stderr)
        return 1
    return 0


def stock_note(target, optimizer, state, dst):
    """A note where the target's stock optimizer, loading the written file as it is, continues otherwise than the
    state's own run: MXNet's says all of it itself (its checkpoint's stock_gap: the file pickles its stock classes);
    elsewhere Keras's Adam's epsilon and a momentum that keeps the rate inside."""
    from ..loader import load_module
    from .checkpoints import state_path
    stock_gap = getattr(load_module(target, "checkpoint"), "stock_gap", None)
    if stock_gap is not None:
        path = state_path(target, dst)
        line = stock_gap(path, optimizer)
        if line:
            print(f"note: stock Gluon code that loads {os.path.basename(path)} continues otherwise than the state's "
                  f"run (this project reads its exact copy): {line}", file=sys.stderr)
        return
    if optimizer.slots == ("exp_avg", "exp_avg_sq"):
        epsilon_hat_note(target, optimizer, state)
    if "momentum_buffer" in optimizer.slots:
        rate_inside_note(target, optimizer, state)


def epsilon_hat_note(target, optimizer, state):
    """A note where the target's stock Adam, loading the file as it is, puts epsilon on the uncorrected sqrt(v)
    (Keras's): by how much its next update differs from the state's own (common.optim.epsilon_hat_gap)."""
    from ..loader import load_module
    stock = getattr(load_module(target, "checkpoint"), "STOCK_ADAM_EPSILON_HAT", None)
    if stock is None:
        return
    names = [key.split(".", 1)[1] for key in state if key.startswith("exp_avg.")]
    moments = [(state[f"exp_avg.{name}"], state[f"exp_avg_sq.{name}"]) for name in names]
    gap = epsilon_hat_gap(optimizer.eps, optimizer.betas[1], state["step"], moments)
    print(f"note: {stock} adds epsilon to the uncorrected sqrt(v): continued by it, the next update differs by "
          f"{gap:.1e} of its size (this project's Adam for {target} computes the state's own)", file=sys.stderr)


def stock_rate_inside(target, optimizer):
    """The target's stock optimizer that loads the file as it is and keeps the rate inside its momentum buffer (the
    file holds -rate * the canonical buffer), or None."""
    from ..loader import load_module
    return getattr(load_module(target, "checkpoint"), "rate_inside", lambda o: None)(optimizer)


def with_rate(optimizer, told, args, target):
    """The optimizer with --lr's rate. A file that says its optimizer (a Gluon states file, a PyTorch general
    checkpoint) says its rate too; a project's own file does not, and a target whose stock optimizer keeps the rate
    in its buffer needs it: without --lr that is an error, not the dataclass's default rate written silently."""
    if args.lr is not None and told is not None and not math.isclose(args.lr, told.lr):
        raise RosettaError(f"{args.src}: its optimizer's rate is {told.lr:g}, not --lr {args.lr:g}")
    if args.lr is not None:
        return dataclasses.replace(optimizer, lr=args.lr, final_lr=min(optimizer.final_lr, args.lr))
    stock = stock_rate_inside(target, optimizer) if told is None and "momentum_buffer" in optimizer.slots else None
    if stock:
        raise RosettaError(f"{args.src} does not say its rate, and {stock}, which loads {args.dst} as it is, keeps "
                           "the rate inside its momentum buffer (the file holds -rate * the buffer): give --lr, the "
                           "rate of its last update")
    return optimizer


def rate_inside_note(target, optimizer, state):
    """A note where the target's stock SGD, loading the file as it is, keeps the rate inside its momentum buffer
    (Keras's, MXNet's): the file holds -rate * the state's buffer, which continues the state's own run only until the
    schedule changes the rate (common.optim.rate_changes)."""
    stock = stock_rate_inside(target, optimizer)
    changes = rate_changes(optimizer, state["step"]) if stock else []
    if changes:
        step, before, rate = changes[0]
        print(f"note: {stock} keeps the rate inside its momentum buffer: continued by it, the run departs from the "
              f"state's own at update {step + 1}, where the schedule changes the rate ({before:.4g} to {rate:.4g}; "
              f"changing {how_often(optimizer, changes)} after the {state['step']} updates made); this project's "
              f"{optimizer.name} for {target} computes the state's own", file=sys.stderr)


def hyperparameters(o):
    """What the written state carries besides its buffers: a stock optimizer that loads it takes these."""
    own = {"sgd": "", "momentum": f", momentum {o.momentum:g}", "nesterov": f", nesterov momentum {o.momentum:g}",
           "adam": f", betas {o.betas}, eps {o.eps:g}", "adamw": f", betas {o.betas}, eps {o.eps:g}",
           "rmsprop": f", alpha {o.alpha:g}, eps {o.eps:g}" + (", centered" if o.centered else "")
           + (f", momentum {o.momentum:g}" if o.momentum else ""), "adagrad": f", eps {o.eps:g}"}[o.name]
    warmup = f" after {o.warmup_steps} warm-up steps" if o.warmup_steps else ""
    shape = {"constant": "", "step": f" (x{o.decay_factor:g} at steps {', '.join(map(str, o.milestones))})",
             "factor": f" (x{o.decay_factor:g} every {o.period} steps)",
             "poly": f" (power {o.power:g} to 0 at step {o.total_steps})",
             "cosine": f" (to {o.final_lr:g} at step {o.total_steps})"}[o.schedule]
    return f"lr {o.lr:g}{own}, weight decay {o.weight_decay:g}, {o.schedule} rate{shape}{warmup}"


def optimizer_of(state, optimizer=None):
    """The optimizer a canonical state is from: `optimizer` (--optimizer's or the file's), or told by its buffers
    (momentum and nesterov keep the same one, adam and adamw the same two: --optimizer tells them apart). rmsprop's
    buffers say whether it was centered and had momentum (0.9 where --optimizer gives no value)."""
    slots = {key.split(".", 1)[0] for key in state if key != "step"}
    if optimizer is None:
        return of_state(slots)
    if set(optimizer.slots) == slots:
        return optimizer
    return dataclasses.replace(optimizer, centered="grad_avg" in slots,
                               momentum=(optimizer.momentum or 0.9) if "momentum_buffer" in slots else 0.0)


def quiet_tensorflow(environ=os.environ):
    """As a command only (a caller's process keeps its own settings: TensorFlow reads these lazily, so setting
    them inside a process that already runs TensorFlow changes its kernels, e.g. NCHW pooling on the CPU)."""
    # TensorFlow's start-up chatter: with oneDNN's custom ops on, TensorFlow 2.21 writes a notice to stderr
    # before its log level applies. Without them the error line is stderr's only line (and --verify compares
    # against TensorFlow's plain kernels).
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


if __name__ == "__main__":
    quiet_tensorflow()
    sys.exit(main())
