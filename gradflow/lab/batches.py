"""The batches a lab run trains and validates on, as `tf.data` pipelines made once per run.

Given NumPy arrays, Keras's `fit` builds a new `tf.data` pipeline at every
epoch, and `evaluate` builds another for the validation data at every
epoch's end. The lab's default run (digits, batch 32: 45 steps an epoch,
then 12 validation batches) spent about half of its time there, not
training: a median 14 ms to start each epoch's pipeline, 62 ms for the
epoch's 45 steps and 39 ms for validation, against 0, 45 and 12 ms with the
pipelines below (one TensorFlow thread, an ad-hoc script of the twenty-third
session; `bench/bench_runner.py` times a bare `fit` both ways).

`fit_inputs` makes the pipelines once, endless, and tells `fit` how many
batches make an epoch (`steps_per_epoch`, `validation_steps`), so that
Keras keeps one iterator of each for the whole run. An epoch is still one
pass over the training examples in a fresh order, in batches of the sizes
Keras makes (the last one smaller when the batch size does not divide the
examples), and every validation is one pass over the validation examples.

Example:

```python
data = load_dataset(config)
model = build_model(config, data)
model.fit(**fit_inputs(data, config.batch_size, config.seed), epochs=7)
```
"""

import math

import tensorflow as tf


def fit_inputs(data, batch_size, seed):
    """Keyword arguments for `model.fit`: a run's training and validation batches.

    Args:
        data: A `gradflow.lab.datasets.Dataset`.
        batch_size: Examples per batch, at least 1.
        seed: Seeds the order of the examples in every epoch; the same seed
            gives the same batches.

    Returns:
        A dict with `x`, `steps_per_epoch`, `validation_data`,
        `validation_steps` and `shuffle` (False: the pipeline shuffles).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    return {
        "x": training_batches(data.x_train, data.y_train, batch_size, seed),
        "steps_per_epoch": math.ceil(len(data.x_train) / batch_size),
        "validation_data": validation_batches(data.x_val, data.y_val, batch_size),
        "validation_steps": math.ceil(len(data.x_val) / batch_size),
        "shuffle": False,
    }


def training_batches(x, y, batch_size, seed):
    """Endless `(x, y)` batches, each epoch's examples in a fresh order.

    The examples stay where they are: what is shuffled is their indices, and
    each batch gathers its rows (a shuffle buffer of the examples themselves
    would hold a second copy of the training set, 600 MB for CIFAR-10).
    """
    x, y = tf.constant(x), tf.constant(y)
    indices = tf.data.Dataset.range(len(x)).shuffle(
        len(x), seed=seed, reshuffle_each_iteration=True
    )
    # Batching before repeating keeps each epoch's last, smaller batch.
    return (
        indices.batch(batch_size)
        .repeat()
        .map(lambda rows: (tf.gather(x, rows), tf.gather(y, rows)))
    )


def validation_batches(x, y, batch_size):
    """Endless `(x, y)` batches of the validation examples, in order, one pass after another."""
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat()
