"""Move a user's own network's parameters and BatchNorm statistics from one framework's model into another's,
matched layer by layer in traversal order and role by role, through the layout changes each role needs
(common/transfer.py; each framework's transfer.py lists a model's layers).

    from harness.training.transfer import transfer
    for row in transfer("mynet-epoch10.params", torch_model):   # a Gluon file, or the Gluon Block itself
        print(row)

The source is a model of any of the four frameworks, or a Gluon save_parameters file; the target is a built model
(a torch.nn.Module, a built Keras model, a Flax NNX module, a Gluon Block) whose tensors are replaced. Returns the
table of what went where (source name and shape -> target name and shape, and the layout change), for the user to
check: Flax orders a module's attributes by name, the others by registration. A missing layer, roles that differ, or
a shape that does not fit is one ValueError naming both sides, and nothing is changed.

    python -m harness.training.transfer SRC.params DST --model mynet.py:build_model [--flat-shape C,H,W]

builds the target model by calling build_model() from the user's file, transfers, prints the table, and saves the
model natively, named for its framework as convert reads names (.pt state_dict, Keras .weights.h5, Flax .orbax)."""
import argparse
import importlib.util
import os
import sys

from common.interface import RosettaError
from common.transfer import converted, flattened_shapes

from ..loader import load_module

MODULES = {"torch": "pytorch", "mxnet": "mxnet", "keras": "tensorflow", "tensorflow": "tensorflow", "flax": "jax"}


def framework_of(model):
    """The framework a model object (or a .params file) belongs to, from its classes' modules."""
    if isinstance(model, (str, os.PathLike)):
        if str(model).endswith(".params"):
            return "mxnet"
        raise ValueError(f"{model}: a source file must be a Gluon save_parameters file (.params)")
    for cls in type(model).__mro__:
        top = cls.__module__.split(".")[0]
        if top in MODULES:
            return MODULES[top]
    raise ValueError(f"a {type(model).__name__} is no torch.nn.Module, Gluon Block, Keras model or Flax NNX module")


def transfer(source, target, flat_shape=None):
    """Copies `source`'s parameters and statistics into `target` (module docstring); returns the table's rows."""
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    src = load_module(framework_of(source), "transfer")
    dst = load_module(framework_of(target), "transfer")
    theirs, ours = src.layers(source), dst.layers(target)
    for i in range(max(len(theirs), len(ours))):
        if i >= len(theirs) or i >= len(ours):
            extra, side = (ours[i], "target") if i >= len(theirs) else (theirs[i], "source")
            raise ValueError(f"the source has {len(theirs)} layers with parameters and the target {len(ours)}: the "
                             f"{side}'s {extra[0]} ({', '.join(extra[1])}) has no counterpart")
        (a, a_roles), (b, b_roles) = theirs[i], ours[i]
        if list(a_roles) != list(b_roles):
            raise ValueError(f"layer {i}: the source's {a} has {', '.join(a_roles)}; the target's {b} has "
                             f"{', '.join(b_roles)}")
    for module, model in ((dst, target), (src, source)):   # a Keras model knows the map its Flatten takes
        flat_shape = flat_shape or getattr(module, "flattened_map", lambda model: None)(model)
    flat = flattened_shapes([{r: a for r, (_, a) in roles.items()} for _, roles in theirs], src.CHANNELS_LAST,
                            flat_shape) if src.CHANNELS_LAST != dst.CHANNELS_LAST else {}   # same order: kept
    arrays, rows = {}, []
    for i, ((_, a_roles), (_, b_roles)) in enumerate(zip(theirs, ours)):
        for role, (name, array) in a_roles.items():
            key, current = b_roles[role]
            value, change = converted(array, role, flat.get(i), src.CHANNELS_LAST, dst.CHANNELS_LAST)
            if value.shape != current.shape:
                raise ValueError(f"{name} {array.shape} -> {key} needs {current.shape}, not {value.shape} "
                                 f"(layer {i}: is the target's layer order the source's?)")
            arrays[key] = value.astype(current.dtype)
            rows.append((name, array.shape, key, current.shape, change))
    dst.assign(target, arrays)
    return rows


def table(rows):
    """The rows as aligned text lines."""
    cells = [(name, str(tuple(a)), "->", key, str(tuple(b)), change) for name, a, key, b, change in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    return [" ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]


def user_function(spec):
    """FILE.py:FUNCTION -> the function, imported from the user's file."""
    path, _, name = spec.rpartition(":")
    if not path or not os.path.exists(path):
        raise RosettaError(f"{spec}: give the model as FILE.py:FUNCTION, a file that exists")
    module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise RosettaError(f"{path} has no function {name}")
    return getattr(module, name)


def flat_shape(text):
    """--flat-shape's C,L or C,H,W or C,D,H,W as a tuple of positive ints."""
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if not 2 <= len(shape) <= 4 or min(shape) < 1:
        raise RosettaError(f"--flat-shape {text}: give C,L, C,H,W or C,D,H,W (positive whole numbers)")
    return shape


def named_for(dst, framework):
    """Refuses a DST whose name is another framework's (convert's framework_of reads it): the name says the format."""
    from .checkpoints import SUFFIXES, framework_of as framework_of_name
    suffix = SUFFIXES[framework]
    named = framework_of_name(dst, f"; name it *{suffix}, as the model is {framework}'s")
    if named != framework:
        raise RosettaError(f"{dst}: a {named} name, but the model is {framework}'s: name it *{suffix}")
    if not dst.rstrip("/").endswith(suffix):   # PyTorch's sharded checkpoint (.dcp): not what torch.save writes
        raise RosettaError(f"{dst}: a sharded checkpoint's name; the model is saved whole: name it *{suffix}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m harness.training.transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a Gluon save_parameters file (.params)")
    p.add_argument("dst", help="where to save the target model, named for its framework (.pt, .weights.h5, .orbax "
                               "for Flax, .params)")
    p.add_argument("--model", required=True, help="FILE.py:FUNCTION that builds the target model (built, for Keras)")
    p.add_argument("--flat-shape", help="C,H,W (C,L after a 1-D conv, C,D,H,W after a 3-D one) of the feature map "
                                        "the first dense layer after a conv flattens (default: equal sides, C from "
                                        "the conv)")
    p.error = lambda message: p.exit(2, f"error: {message} (see python -m harness.training.transfer --help)\n")
    args = p.parse_args(argv)
    try:
        flat = flat_shape(args.flat_shape) if args.flat_shape else None
        if not os.path.exists(args.src):
            raise RosettaError(f"{args.src}: no such file")
        load_module(framework_of(args.src), "transfer")   # MXNet first, through the loader's numpy shim
        model = user_function(args.model)()
        named_for(args.dst, framework_of(model))
        try:
            rows = transfer(args.src, model, flat)
        except ValueError as err:
            raise RosettaError(f"{args.src} -> {args.model}: {err}")
        print("\n".join(table(rows)))
        load_module(framework_of(model), "transfer").save(model, args.dst)
        print(f"wrote {args.dst}")
        from .checkpoints import state_path
        states = state_path("mxnet", args.src)
        if os.path.exists(states):   # the Trainer's states saved with these weights: said, not left without a word
            print(f"note: {os.path.basename(states)} beside it not carried: this moves a network's weights and "
                  "BatchNorm statistics; its optimizer state goes across only for this repo's networks "
                  "(python -m harness.training.convert)", file=sys.stderr)
    except (RosettaError, ValueError) as err:   # ValueError: a source that is not a Gluon .params file
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
