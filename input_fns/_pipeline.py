"""The common tail of every input pipeline: shuffle, repeat, batch, prefetch."""
from typing import Callable, Optional

import tensorflow as tf

from tfe_estimator.validation import is_int

__all__ = ["SHUFFLE_BUFFER_SIZE", "check_epochs", "shuffle_repeat_batch"]

SHUFFLE_BUFFER_SIZE = 10_000  # records held for shuffling files; numpy shuffles fully


def check_epochs(num_epochs: Optional[int], caller: str) -> None:
    """Raises ValueError unless `num_epochs` is None (forever) or an int >= 1."""
    if num_epochs is not None and not is_int(num_epochs, minimum=1):
        raise ValueError(
            f"{caller}: num_epochs must be None (repeat forever) or an int >= 1, got {num_epochs!r}."
        )


def shuffle_repeat_batch(
    dataset: tf.data.Dataset,
    batch_size: int,
    num_epochs: Optional[int],
    shuffle: bool,
    seed: Optional[int],
    buffer_size: int = SHUFFLE_BUFFER_SIZE,
    parse_batch: Optional[Callable] = None,
) -> tf.data.Dataset:
    """Shuffles within each epoch (reshuffling every epoch), repeats, batches.

    `parse_batch`, if given, maps each batch of raw records (e.g. CSV lines)
    to `(features, labels)`: parsing whole batches is faster than records.

    The last batch may be smaller when `num_epochs` is set, as with
    `tf.compat.v1.estimator.inputs.numpy_input_fn`: evaluation sees every record.
    """
    if shuffle:
        dataset = dataset.shuffle(buffer_size, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.repeat(num_epochs)
    dataset = dataset.batch(batch_size)
    if parse_batch is not None:
        dataset = dataset.map(parse_batch, num_parallel_calls=tf.data.AUTOTUNE)
    return dataset.prefetch(tf.data.AUTOTUNE)
