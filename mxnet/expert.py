"""What a performance-minded MXNet user writes instead of the recipe, the yardstick of its speed (harness/studies/expert.py):
the forward hybridized (one cached graph, its backward too), the update by MXNet's fused `sgd_update` operator into
each weight, the scratch step's layout (NCHW, the only one) and its data path (a numpy batch copied to the context
every step). The recipe's step on one context differs by what it shows: the all-reduce's loop over the 8 gradients
(a copy each, no-ops on one context but engine pushes) and an update of two ops per parameter (scale, subtract)."""
from mxnet import autograd, nd

from .lenet import forward, get_params, hybridized, loss_sum

compiled = hybridized(forward)


def get_model(weights, device):
    return get_params(weights, device)


def train_step(params, X, y, device, lr, batch_size):
    """One step in place; the mean loss, as data_parallel.train_step returns it."""
    X, y = nd.array(X, ctx=device), nd.array(y, ctx=device)
    with autograd.record():
        loss = loss_sum(compiled(params, X), y)
    loss.backward()
    for p in params:
        nd.sgd_update(p, p.grad, lr=lr / batch_size, wd=0.0, out=p)
    return loss.asscalar() / len(X)
