"""What a performance-minded JAX user writes instead of the recipe, the yardstick of its speed (harness/studies/expert.py):
the whole step, gradient and update, in one jax.jit, the parameters' buffers donated to it (XLA writes the new
weights into the old ones' memory), in the scratch step's layout (lenet.py's) and with its data path, a numpy batch
put on the device every step. The recipe's step on one device differs by what it shows: two compiled calls
(data_parallel.loss_and_grads, then update) instead of one, and between them the all-reduce, a loop over the 8
parameters that copies each onto the device that holds it (jax.device_put, a no-op on one device but a dispatch)."""
import functools

import jax

from .lenet import forward, get_params, loss_sum


def get_model(weights, device):
    return get_params(weights, device)


@functools.partial(jax.jit, donate_argnums=0)
def update(params, X, y, scale):
    loss, grads = jax.value_and_grad(lambda p: loss_sum(forward(p, X), y))(params)
    return [p - scale * g for p, g in zip(params, grads)], loss


def train_step(params, X, y, device, lr, batch_size):
    """One step in place of the list's arrays; the mean loss, as data_parallel.train_step returns it."""
    X, y = jax.device_put(X, device), jax.device_put(y, device)
    params[:], loss = update(params, X, y, lr / batch_size)
    return float(loss) / len(X)
