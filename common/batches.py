"""The order in which training examples are seen: identical for every framework and every process."""
import numpy as np


def epoch_batches(n, batch_size, seed, epoch, min_size=1):
    """Index arrays of one epoch's batches: a fresh permutation per (seed, epoch). A last batch with
    fewer than min_size rows (one per device) is dropped; all others are kept, the last may be short."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    return [b for b in batches if len(b) >= min_size]
