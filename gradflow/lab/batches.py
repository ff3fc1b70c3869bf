"""The batches a lab run trains and validates on, as `tf.data` pipelines made once per run.

Given NumPy arrays, Keras's `fit` builds a new `tf.data` pipeline at every
epoch, and `evaluate` builds another for the validation data at every
epoch's end. The lab's default run (digits, batch 32: 45 steps an epoch,
then 12 validation batches) spent about half of its time there, not
training: a median 14 ms to start each epoch's pipeline, 62 ms for the
epoch's 45 steps and 39 ms for validation, against 0, 45 and 12 ms with the
pipelines below (one TensorFlow thread, an ad-hoc script of the twenty-third
session; `bench/bench_runner.py` times a bare `fit` both ways).

`fit_inputs` makes the pipelines once. The training one is endless and
`fit` is told how many batches make an epoch (`steps_per_epoch`), so that
Keras keeps one iterator for the whole run. An epoch is still one pass over
the training examples in a fresh order, in batches of the sizes Keras makes
(the last one smaller when the batch size does not divide the examples).
The validation pipeline is one pass over the validation examples: `fit`
starts a new iterator over it at every epoch's end, which costs little for
a `tf.data` pipeline (it is the arrays that Keras made a pipeline of anew),
and a pass that ends by itself stays one pass whatever
`steps_per_execution` is (given `validation_steps`, Keras rounds the steps
up to whole executions).

`steps_per_execution` picks how many steps the lab's compiled train
function runs per call: Keras's own work around each call (callbacks,
iterator, logs) costs more than the lab model's step itself.

Example:

```python
data = load_dataset(config)
model = build_model(config, data)
model.fit(**fit_inputs(data, config.batch_size, config.seed), epochs=7)
```
"""

import math

import tensorflow as tf

from gradflow.checks import positive_int


def fit_inputs(data, batch_size, seed):
    """Keyword arguments for `model.fit`: a run's training and validation batches.

    Args:
        data: A `gradflow.lab.datasets.Dataset`.
        batch_size: Examples per batch, at least 1.
        seed: Seeds the order of the examples in every epoch; the same seed
            gives the same batches.

    Returns:
        A dict with `x`, `steps_per_epoch`, `validation_data` and `shuffle`
        (False: the pipeline shuffles).
    """
    batch_size = positive_int("batch_size", batch_size)
    return {
        "x": training_batches(data.x_train, data.y_train, batch_size, seed),
        "steps_per_epoch": math.ceil(len(data.x_train) / batch_size),
        "validation_data": validation_batches(data.x_val, data.y_val, batch_size),
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
    """`(x, y)` batches of the validation examples, in order: one pass per iterator."""
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


# Steps a call of the train function runs: at most this many, and at least
# this many calls a run, so that a run's compiled metrics (accuracy), which
# Keras reports once a call, keep enough points for a chart.
MAX_STEPS_PER_EXECUTION = 9
MIN_CALLS_PER_RUN = 50


def steps_per_execution(steps_per_epoch, total_steps):
    """How many steps each call of a lab run's train function should run.

    The lab's default model took about 0.55 ms a step inside its compiled
    function and 1.35 ms in a bare `fit` (twenty-third session,
    `bench/bench_monitor_step.py` and `bench/bench_runner.py`): most was Keras's work
    around every call (callbacks, the iterator, logs). Running several
    steps per call (`model.steps_per_execution`) shares that cost among
    them: with 5, the runner trained the default model 1.5 times as fast as
    a plain `fit` (`bench/bench_runner.py`, twenty-fourth session).

    The number divides the steps of an epoch and the run's total, so that
    every epoch ends, and the run stops, on a call's last step: the steps,
    the batches and the statistics stay those of one step per call. It is at
    most `MAX_STEPS_PER_EXECUTION`, and small enough to leave the run
    `MIN_CALLS_PER_RUN` calls (Keras reports compiled metrics once a call).
    A short run, or an awkward step count (a prime number of batches per
    epoch), gets 1.

    Example:

    >>> steps_per_execution(45, 300)    # gcd 15, at most 300 // 50 = 6
    5
    >>> steps_per_execution(45, 60)
    1

    Args:
        steps_per_epoch: Batches per epoch, at least 1.
        total_steps: Steps the run takes, at least 1.

    Returns:
        An int from 1 to `MAX_STEPS_PER_EXECUTION`.
    """
    steps_per_epoch = positive_int("steps_per_epoch", steps_per_epoch)
    total_steps = positive_int("total_steps", total_steps)
    common = math.gcd(steps_per_epoch, total_steps)
    limit = min(MAX_STEPS_PER_EXECUTION, max(1, total_steps // MIN_CALLS_PER_RUN))
    return max(d for d in range(1, limit + 1) if common % d == 0)
