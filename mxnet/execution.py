"""How the step runs: MXNet executes imperatively, op by op, unless hybridize traces the model into a
cached graph whose memory is planned once and reused every step (static_alloc)."""
from common.interface import exec_level

from . import lenet

NAMES = {"eager": "imperative", "graph": "hybridize"}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"imperative": "nothing", "hybridize": "fwd+bwd"}   # the CachedOp runs its backward as a graph too
DEFAULT = "graph"


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here."""
    level = exec_level(level, NAMES, DEFAULT, "MXNet")
    lenet.lenet.hybridize(active=level == "graph", static_alloc=True, static_shape=True)
    return NAMES[level]
