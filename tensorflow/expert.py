"""What a performance-minded TensorFlow user writes instead of the recipe, the yardstick of its speed
(harness/studies/expert.py): the whole step, gradient and update, in one tf.function, in the scratch step's layout (lenet.py's
NHWC) and with its data path (a numpy batch converted on the device every step). The recipe's step on one device
is one tf.function too; it differs by what it shows: the all-reduce (an add_n and an identity per gradient, which
the graph keeps) and the optimizer's branch."""
import tensorflow as tf

from .lenet import forward, get_params, loss_sum


def get_model(weights, device):
    return get_params(weights, device)


@tf.function(reduce_retracing=True)
def update(params, X, y, scale):
    with tf.GradientTape() as tape:
        loss = loss_sum(forward(params, X), y)
    for p, g in zip(params, tape.gradient(loss, params)):
        p.assign_sub(scale * g)
    return loss


def train_step(params, X, y, device, lr, batch_size):
    """One step in place; the mean loss, as data_parallel.train_step returns it."""
    with tf.device(device):
        loss = update(params, tf.convert_to_tensor(X), tf.convert_to_tensor(y), tf.constant(lr / batch_size))
    return float(loss) / len(X)
