"""chain_gradients against one joint tape written here."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradflow
from gradflow.probe.chain import ChainedBackprop, split_cnn, toy_batch


def assert_float32_close(got, expected):
    """Equal up to float32 rounding: summed in another order, an entry is off by a few
    ulps of the array's largest entries (not of itself), so small entries of a large
    array get an absolute allowance of that scale (CI saw 1.2e-7 beside entries of 0.9)."""
    got, expected = np.asarray(got), np.asarray(expected)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=max(1e-7, 1e-6 * scale))


def joint_tape(parts, x, y, loss_fn):
    """One tape over the whole composition: gradients and dLoss/d(output of each part)."""
    with tf.GradientTape(persistent=True) as tape:
        h, outputs = tf.constant(x), []
        for part in parts:
            h = part(h)
            outputs.append(h)
        value = loss_fn(y, h)
    weights = [tape.gradient(value, part.trainable_variables) for part in parts]
    upstream = [tape.gradient(value, out) for out in outputs]
    return float(value), weights, upstream


def mse(y, p):
    return tf.reduce_mean(tf.square(tf.cast(y, p.dtype) - p))


def split_mlp():
    parts = [
        keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh")]),
        keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)]
        ),
    ]
    rng = np.random.default_rng(0)
    return (
        parts,
        rng.normal(size=(7, 6)).astype("float32"),
        rng.normal(size=(7, 3)).astype("float32"),
    )


def single_part():
    part = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(1)
    return (
        [part],
        rng.normal(size=(4, 3)).astype("float32"),
        rng.normal(size=(4, 2)).astype("float32"),
    )


def teaching_cnn():
    x, y = toy_batch(6, input_shape=(7, 7, 1), seed=3)
    return split_cnn(input_shape=(7, 7, 1), seed=3), x, y


CASES = [teaching_cnn, split_mlp, single_part]


@pytest.mark.parametrize("method", ["vjp", "jacobian"])
@pytest.mark.parametrize("build", CASES, ids=[c.__name__ for c in CASES])
def test_equals_one_joint_tape(build, method):
    parts, x, y = build()
    result = gradflow.chain_gradients(parts, x, y, loss="mse", method=method)
    value, weights, upstream = joint_tape(parts, x, y, mse)
    assert result.method == method
    assert result.loss == pytest.approx(value, rel=1e-5)
    assert len(result) == len(parts)
    for part, got, expected in zip(parts, result, weights, strict=True):
        assert len(got) == len(part.trainable_variables)
        for g, e in zip(got, expected, strict=True):
            assert_float32_close(g.numpy(), e.numpy())
    for got, expected in zip(result.upstream, upstream, strict=True):
        assert_float32_close(got.numpy(), expected.numpy())


def test_softmax_head_gives_output_gradient_of_the_probabilities():
    parts = [
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu")]),
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="softmax")]),
    ]
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(5, 4)).astype("float32"), rng.integers(0, 3, 5)
    result = gradflow.chain_gradients(parts, x, y, loss="sparse_categorical_crossentropy")
    with tf.GradientTape() as tape:
        p = parts[1](parts[0](x))
        value = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, p))
    for g, e in zip(
        result[0] + result[1],
        tape.gradient(value, parts[0].trainable_variables + parts[1].trainable_variables),
        strict=True,
    ):
        assert_float32_close(g.numpy(), e.numpy())
    # d(-mean log p_y)/dp for probabilities that sum to 1 (Keras renormalizes): (1 - onehot/p) / n.
    probs = p.numpy()
    expected = (1.0 - np.eye(3)[y] / probs) / len(y)
    np.testing.assert_allclose(result.upstream[1].numpy(), expected, rtol=1e-4)


@pytest.mark.parametrize("method", ["vjp", "jacobian"])
def test_a_saturated_sigmoid_head_gets_the_gradients_of_its_loss(method):
    """The Jacobian way chained through the probabilities: 0 where one rounds to 1,
    so every gradient came out 0 while the loss's were 20 and 2."""
    parts = [
        keras.Sequential(
            [
                keras.Input((2,)),
                keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(10.0)),
            ]
        ),
        keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(
                    1, activation="sigmoid", kernel_initializer=keras.initializers.Constant(2.0)
                ),
            ]
        ),
    ]
    x = np.array([[1.0, 1.0], [2.0, 2.0], [-1.0, -1.0], [3.0, 3.0]], "float32")
    y = np.array([[0.0], [0.0], [1.0], [1.0]], "float32")
    assert (np.abs(parts[1](parts[0](x)).numpy() - 0.5) == 0.5).all()  # saturated
    loss = keras.losses.BinaryCrossentropy()
    value, weights, _ = joint_tape(parts, x, y, loss)
    result = gradflow.chain_gradients(parts, x, y, loss="binary_crossentropy", method=method)
    assert result.loss == pytest.approx(value, rel=1e-6)
    for got, expected in zip(result[0] + result[1], weights[0] + weights[1], strict=True):
        assert_float32_close(got.numpy(), expected.numpy())
    assert np.abs(result[1][0].numpy()).max() == pytest.approx(20.0)


def test_the_last_part_of_a_masked_sequence_receives_the_gradient_of_the_masked_loss():
    """`upstream[-1]` through the loss's formula keeps the output's mask (padded steps 0)."""
    keras.utils.set_random_seed(0)
    body = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(6, 3, mask_zero=True),
            keras.layers.LSTM(4, return_sequences=True),
        ]
    )
    head = keras.layers.Dense(2)
    x = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    y = np.random.default_rng(0).normal(size=(3, 5, 2)).astype(np.float32)
    loss = keras.losses.MeanSquaredError()
    result = gradflow.chain_gradients([body, head], x, y, loss=loss)
    with tf.GradientTape() as tape:
        y_pred = head(body(x))
        value = loss(y, y_pred)
    expected = tape.gradient(value, y_pred)
    assert np.mean(expected.numpy() == 0) == pytest.approx(5 / 15)  # the padded steps
    assert_float32_close(result.upstream[-1], expected)


def test_the_jacobian_way_says_it_needs_one_tensor_per_part():
    """A part that hands over a tuple failed with "'tuple' object has no attribute 'shape'"."""
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2)(inputs)
    pair = keras.Model(inputs, (dense, dense * 2.0))
    both = keras.Input((2,)), keras.Input((2,))
    head = keras.Model(list(both), keras.layers.Dense(1)(keras.layers.Add()(list(both))))
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    assert (
        len(gradflow.chain_gradients([pair, head], x, y, loss="mse")) == 2
    )  # the VJP way takes it
    with pytest.raises(ValueError, match=r"needs parts that each give one tensor; `models\[0\]`"):
        gradflow.chain_gradients([pair, head], x, y, loss="mse", method="jacobian")


@pytest.mark.parametrize("method", ["vjp", "jacobian"])
def test_parts_that_do_not_fit_are_named(method):
    """The message was a thousand characters of traced graph that never named the parts."""
    below = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6)])
    above = keras.Sequential([keras.Input((7,)), keras.layers.Dense(1)])
    x, y = np.ones((5, 4), "float32"), np.ones((5, 1), "float32")
    with pytest.raises(ValueError) as caught:
        gradflow.chain_gradients([below, above], x, y, loss="mse", method=method)
    message = str(caught.value)
    assert message.startswith("`models[1]` does not take the output of `models[0]` (shape (5, 6))")
    assert "expected axis -1 of input shape to have value 7" in message
    assert "in user code" not in message and "\x1b" not in message


def test_reusable_backprop_follows_new_batches():
    parts, x, y = split_mlp()
    backprop = ChainedBackprop(parts, loss="mse")
    for scale in (1.0, -2.0):
        result = backprop(scale * x, y)
        _, weights, _ = joint_tape(parts, scale * x, y, mse)
        assert_float32_close(result[0][0].numpy(), weights[0][0].numpy())


def test_jacobian_size_guard_names_the_limit():
    parts = split_cnn()
    x, y = toy_batch(16)
    with pytest.raises(ValueError, match="max_jacobian_entries"):
        gradflow.chain_gradients(
            parts, x, y, loss="mse", method="jacobian", max_jacobian_entries=50_000
        )


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"models": []}, ValueError, "at least one"),
        ({"models": "parts"}, TypeError, "`models`"),
        ({"models": [object()]}, TypeError, r"`models\[0\]`"),
        ({"method": "hessian"}, ValueError, "`method`"),
        ({"max_jacobian_entries": 0}, ValueError, "`max_jacobian_entries`"),
        ({"loss": None}, ValueError, "not compiled"),
    ],
)
def test_argument_errors(kwargs, error, words):
    parts, x, y = split_mlp()
    arguments = {"models": parts, "x": x, "y": y, "loss": "mse", **kwargs}
    with pytest.raises(error, match=words):
        gradflow.chain_gradients(**arguments)


def test_batch_mismatch_is_refused():
    parts, x, y = split_mlp()
    with pytest.raises(ValueError, match="same number of samples"):
        gradflow.chain_gradients(parts, x, y[:2], loss="mse")


def test_split_cnn_is_the_documented_teaching_model():
    first = split_cnn(seed=5)
    again = split_cnn(seed=5)
    other = split_cnn(seed=6)
    assert [type(layer).__name__ for part in first for layer in part.layers] == [
        "Conv2D",
        "Conv2D",
        "Flatten",
        "Dense",
    ]
    assert first[2].layers[-1].activation.__name__ == "sigmoid"
    for a, b in zip(first[0].get_weights(), again[0].get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0].get_weights()[0], other[0].get_weights()[0])
    x, y = toy_batch(4)
    assert x.shape == (4, 8, 8, 1) and y.shape == (4, 1)
    with pytest.raises(ValueError, match="`input_shape`"):
        split_cnn(input_shape=(3, 3, 1))


def test_split_lesson_skips_jacobians_past_the_limit_and_still_agrees():
    """A size whose largest Jacobian is over the limit runs the VJP way alone."""
    from gradflow.probe.split_lesson import split_backprop_lesson

    # The largest Jacobians: 147,456 entries at 6x6, 589,824 at 8x8.
    lesson = split_backprop_lesson(sizes=(6, 8), repeats=1, max_jacobian_entries=300_000)
    cost = lesson.cost.set_index(["input_size", "method"])
    assert cost.loc[(6, "jacobian"), "formed"] and not cost.loc[(8, "jacobian"), "formed"]
    assert np.isnan(cost.loc[(8, "jacobian"), "milliseconds"])
    assert cost.loc[(8, "vjp"), "milliseconds"] > 0
    assert lesson.agreement[["vjp", "jacobian"]].max().max() < 1e-5
    alone = split_backprop_lesson(sizes=(8,), repeats=1, max_jacobian_entries=300_000)
    assert alone.agreement["jacobian"].isna().all() and (alone.agreement["vjp"] < 1e-5).all()


def test_training_pass_leaves_batchnorm_statistics_alone():
    parts = [
        keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization()]
        ),
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
    ]
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(6, 3)) + 2.0, rng.normal(size=(6, 1))
    before = [v.numpy().copy() for v in parts[0].non_trainable_variables]
    result = ChainedBackprop(parts, loss="mse", training=True)(x, y)
    for variable, value in zip(parts[0].non_trainable_variables, before, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value)
    with tf.GradientTape() as tape:
        value = mse(y, parts[1](parts[0](tf.constant(x, tf.float32), training=True)))
    expected = tape.gradient(value, parts[1].trainable_variables)
    for got, want in zip(result[1], expected, strict=True):
        assert_float32_close(got.numpy(), want.numpy())
