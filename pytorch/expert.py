"""What a performance-minded PyTorch user writes instead of the recipe, the yardstick of its speed (harness/studies/expert.py):
the step as one function, in the scratch step's layout (lenet.py's channels-last) and with its data path (a numpy
batch copied to the device every step), the update of every parameter in one fused call (torch._foreach_add_, as
torch.optim's foreach SGD). Eager: torch.compile of the forward is no faster here (docs/results.md). The recipe's
step on one device differs by what it shows: the all-reduce's loop over the 8 gradients (an add and a copy each,
no-ops on one device but dispatches) and an update loop of one op per parameter."""
import torch

from .lenet import forward, get_params, loss_sum, to_layout


def get_model(weights, device):
    return get_params(weights, device)


def train_step(params, X, y, device, lr, batch_size):
    """One step in place; the mean loss, as data_parallel.train_step returns it."""
    X, y = to_layout(torch.tensor(X, device=device)), torch.tensor(y, device=device)
    loss = loss_sum(forward(params, X), y)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=-lr / batch_size)
    return loss.item() / len(X)
