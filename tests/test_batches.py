"""The lab's input pipelines: whole shuffled epochs, validation passes, seeds, and `fit` with them."""

import itertools

import numpy as np
import pytest

from gradflow.lab.batches import fit_inputs
from gradflow.lab.datasets import Dataset


def numbered(n_train, n_val, features=3):
    """A data set whose every example says which one it is: x[i] = [i, i, ...], y[i] = i."""
    x = np.repeat(np.arange(n_train, dtype="float32")[:, None], features, axis=1)
    x_val = 1000.0 + np.repeat(np.arange(n_val, dtype="float32")[:, None], features, axis=1)
    return Dataset(
        x_train=x,
        y_train=np.arange(n_train, dtype="int32"),
        x_val=x_val,
        y_val=np.arange(n_val, dtype="int32"),
        n_classes=None,
        task="regression",
        input_shape=(features,),
        description="numbered examples",
    )


def epochs_of(inputs, epochs):
    """The training batches' labels, epoch by epoch, as `fit` would take them."""
    batches = iter(inputs["x"])
    return [
        [next(batches)[1].numpy() for _ in range(inputs["steps_per_epoch"])] for _ in range(epochs)
    ]


def test_every_epoch_is_one_pass_in_a_fresh_order_with_keras_batch_sizes():
    inputs = fit_inputs(numbered(70, 9), batch_size=32, seed=5)
    assert inputs["steps_per_epoch"] == 3 and inputs["shuffle"] is False
    epochs = epochs_of(inputs, 4)
    orders = []
    for batches in epochs:
        # As Keras makes them from arrays: full batches, then the rest.
        assert [len(b) for b in batches] == [32, 32, 6]
        order = np.concatenate(batches)
        assert sorted(order.tolist()) == list(range(70))
        orders.append(order.tolist())
    assert len({tuple(o) for o in orders}) == 4, "each epoch should have an order of its own"
    assert orders[0] != list(range(70))


def test_features_travel_with_their_labels():
    batches = iter(fit_inputs(numbered(50, 5, features=4), batch_size=8, seed=1)["x"])
    for x, y in itertools.islice(batches, 20):
        np.testing.assert_array_equal(x.numpy(), np.repeat(y.numpy()[:, None], 4, axis=1))


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    data = numbered(40, 4)
    first, again, other = (
        np.concatenate(sum(epochs_of(fit_inputs(data, 16, seed), 2), [])) for seed in (3, 3, 4)
    )
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_each_validation_is_one_pass_in_order():
    inputs = fit_inputs(numbered(20, 11), batch_size=4, seed=0)
    assert "validation_steps" not in inputs  # the pass ends by itself
    for _ in range(3):  # one pass per epoch's validation, always from the first example
        labels = [y.numpy() for _, y in inputs["validation_data"]]
        assert [len(b) for b in labels] == [4, 4, 3]
        assert np.concatenate(labels).tolist() == list(range(11))


@pytest.mark.parametrize(
    "steps_per_epoch, total_steps, expected",
    [
        (45, 300, 5),  # the lab's default run: gcd 15, at most 300 // 50 = 6
        (45, 9000, 9),  # long runs: at most MAX_STEPS_PER_EXECUTION
        (45, 60, 1),  # short runs keep a metric point a step
        (23, 10_000, 1),  # digits in batches of 64: a prime epoch
        (3, 150, 3),
        (12, 1, 1),
    ],
)
def test_steps_per_execution_divides_epochs_and_runs(steps_per_epoch, total_steps, expected):
    from gradflow.lab.batches import MAX_STEPS_PER_EXECUTION, steps_per_execution

    k = steps_per_execution(steps_per_epoch, total_steps)
    assert k == expected
    assert steps_per_epoch % k == 0 and total_steps % k == 0
    assert 1 <= k <= MAX_STEPS_PER_EXECUTION


@pytest.mark.parametrize("argument", [0, -1, 2.0, True, None])
def test_steps_per_execution_names_a_bad_argument(argument):
    from gradflow.lab.batches import steps_per_execution

    with pytest.raises(ValueError, match="`steps_per_epoch`"):
        steps_per_execution(argument, 100)
    with pytest.raises(ValueError, match="`total_steps`"):
        steps_per_execution(45, argument)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, "32", None, True])
def test_a_bad_batch_size_is_named(batch_size):
    with pytest.raises(ValueError, match="batch_size.*" + repr(batch_size).replace(".", r"\.")):
        fit_inputs(numbered(10, 2), batch_size=batch_size, seed=0)


@pytest.mark.parametrize("steps_per_execution", [1, 5])
def test_fit_takes_whole_epochs_and_validates_like_keras_from_arrays(steps_per_execution):
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    data = numbered(45, 13)
    data.x_train = rng.normal(size=(45, 3)).astype("float32")
    data.y_train = rng.normal(size=45).astype("float32")
    data.x_val = rng.normal(size=(13, 3)).astype("float32")
    data.y_val = rng.normal(size=13).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="mse",
        steps_per_execution=steps_per_execution,
    )

    seen = []
    batches = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch)
    )
    history = model.fit(
        **fit_inputs(data, batch_size=10, seed=0), epochs=3, verbose=0, callbacks=[batches]
    )
    # Keras calls back once a call, with the call's last batch.
    assert seen == list(range(steps_per_execution - 1, 5, steps_per_execution)) * 3
    assert int(model.optimizer.iterations.numpy()) == 15
    # The last epoch's validation loss: Keras's own evaluate, from the arrays.
    expected = model.evaluate(data.x_val, data.y_val, batch_size=10, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][-1], expected, rtol=1e-6)
