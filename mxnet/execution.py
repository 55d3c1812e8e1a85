"""How the step runs: MXNet executes imperatively, op by op, unless hybridize traces the model into a
cached graph whose memory is planned once and reused every step (static_alloc)."""
from common.interface import Unavailable

from . import lenet

NAMES = {"eager": "imperative", "graph": "hybridize"}
DEFAULT = "graph"


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here."""
    level = DEFAULT if level == "default" else level
    if level not in NAMES:
        raise Unavailable(f"MXNet has no {level!r} mode here (choose from {', '.join(NAMES)})")
    lenet.lenet.hybridize(active=level == "graph", static_alloc=True, static_shape=True)
    return NAMES[level]
