"""Backpropagation through a model split into parts, one tape per part.

When a network is cut into parts (pipeline stages, a frozen encoder and a
head, the three boxes of a lecture slide), each part can record its own
`tf.GradientTape`. The chain rule then joins them: the part nearest the loss
gets dLoss/d(its output) and hands dLoss/d(its input) down to the part below,
which passes it as `output_gradients` to its own tape. Each hand-over is a
vector-Jacobian product: no Jacobian is ever formed, and the cost is that of
one ordinary backward pass.

`method="jacobian"` does the same arithmetic the slow way, for teaching: it
builds every part's full Jacobian (`tape.jacobian`), flattens it to a matrix
and multiplies the matrices. Its memory grows with (output size) x (input
size), which is why a size guard refuses large cases.

Example:

```python
parts = split_cnn()
x, y = toy_batch(8)
result = chain_gradients(parts, x, y, loss="mse")
result[0]            # gradients of parts[0].trainable_variables
result.upstream[1]   # dLoss/d(output of parts[1]), what parts[1]'s tape received
```
"""

import collections.abc
import contextlib
import dataclasses
import re

import keras
import numpy as np
import tensorflow as tf

from gradflow.checks import check_backend, flag, legacy_keras_words, positive_int
from gradflow.probe import capture
from gradflow.probe.sensitivity import restored_state, to_tensors
from gradflow.probe.snapshot import check_batch_sizes, resolve_loss

METHODS = ("vjp", "jacobian")

# 2e7 float32 entries is 80 MB for the largest Jacobian: enough for the toy
# models of a lesson, small enough not to stall a shared machine.
DEFAULT_MAX_JACOBIAN_ENTRIES = 20_000_000


@dataclasses.dataclass(frozen=True)
class ChainGradients(collections.abc.Sequence):
    """Weight gradients of each part, and what each part received from above.

    It is a sequence of per-part gradient lists, so `chain_gradients(...)[i]`
    is the list of gradients of `models[i].trainable_variables`.

    Attributes:
        gradients: One list of tensors per part, aligned with that part's
            `trainable_variables`.
        upstream: One tensor per part: dLoss/d(output of that part), the
            `output_gradients` its tape was given (for the last part, the
            gradient of the loss with respect to the model's prediction,
            through the loss's formula on its values: Keras's cross-entropies
            differentiate a sigmoid/softmax output through its logits, so
            where a probability rounds to 0 or 1 this is 0 while the weights'
            gradients are not).
        loss: The scalar loss (batch mean) as a float.
        method: `"vjp"` or `"jacobian"`.
    """

    gradients: list
    upstream: list
    loss: float
    method: str

    def __getitem__(self, index):
        return self.gradients[index]

    def __len__(self):
        return len(self.gradients)


class ChainedBackprop:
    """A compiled chained backward pass over fixed parts, reusable across batches.

    `chain_gradients` is the one-shot form; keep a `ChainedBackprop` when you
    call it for many batches, so that the graph is traced only once.

    Args:
        models: A non-empty list of Keras models or layers, applied in order:
            `models[i + 1]` takes the output of `models[i]`.
        loss: A Keras loss object, its name (`"mse"`), a callable
            `(y_true, y_pred)`, or `None` for the last part's compiled loss.
        method: `"vjp"` (default) chains vector-Jacobian products through
            `output_gradients`; `"jacobian"` forms and multiplies the full
            Jacobians (slow, for teaching).
        max_jacobian_entries: With `method="jacobian"`, the largest number of
            entries one Jacobian may have. Defaults to 20,000,000.
        training: Forward pass in training mode. Defaults to `False`. With
            `True`, BatchNormalization's moving statistics (and Dropout's seed
            state, so every call draws the same masks) are restored after each
            call; so are, in either mode, stateful RNNs' carried states.

    Raises:
        TypeError: if `models` is not a list of Keras layers.
        ValueError: if `models` is empty, `method` unknown, or the loss is
            unusable (see `gradflow.probe.snapshot.resolve_loss`).
    """

    def __init__(
        self,
        models,
        loss=None,
        method="vjp",
        max_jacobian_entries=DEFAULT_MAX_JACOBIAN_ENTRIES,
        training=False,
    ):
        check_backend("gradflow.chain_gradients")
        if isinstance(models, keras.layers.Layer) or not isinstance(models, (list, tuple)):
            raise TypeError(
                "`models` must be a list of Keras models (the parts, input side "
                f"first), got {type(models).__name__}."
            )
        if not models:
            raise ValueError("`models` must hold at least one model, got an empty list.")
        for i, model in enumerate(models):
            legacy = legacy_keras_words(model)
            if legacy is not None:
                raise TypeError(f"`models[{i}]` must be a Keras 3 model or layer: {legacy}.")
            if not isinstance(model, keras.layers.Layer):
                raise TypeError(
                    f"`models[{i}]` must be a Keras model or layer, got {type(model).__name__}."
                )
        if method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
        self.max_jacobian_entries = positive_int("max_jacobian_entries", max_jacobian_entries)
        self.models = list(models)
        self.loss_fn = resolve_loss(self.models[-1], loss)
        self.method = method
        self.training = flag("training", training)
        self._checked_shapes = set()
        backward = self._vjp if method == "vjp" else self._jacobian
        self._compiled = tf.function(backward)

    def __call__(self, x, y):
        """Backpropagate one batch through the parts.

        Args:
            x: Inputs of the first part (numpy array or tensor).
            y: Targets for the output of the last part.

        Returns:
            A `ChainGradients`.

        Raises:
            ValueError: if `x` and `y` hold different numbers of samples, or
                (`method="jacobian"`) a Jacobian would exceed
                `max_jacobian_entries`.
        """
        x = to_tensors(x, "x")
        y = to_tensors(y, "y")
        check_batch_sizes(x, y)
        shape = tuple(getattr(x, "shape", ()))
        if shape not in self._checked_shapes or not all(m.built for m in self.models):
            self._check_parts(x)
            self._checked_shapes.add(shape)
        with contextlib.ExitStack() as stack:
            for model in self.models:
                stack.enter_context(restored_state(model))
            loss, gradients, upstream = self._compiled(x, y)
        return ChainGradients(
            gradients=[list(g) for g in gradients],
            upstream=list(upstream),
            loss=float(loss),
            method=self.method,
        )

    def _forward_last(self, h, y):
        """The last part and the loss, on one tape; returns what the backward needs."""
        model = self.models[-1]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(h)
            y_pred = model(h, training=self.training)
            loss = tf.reduce_mean(tf.cast(self.loss_fn(y, y_pred), tf.float32))
            # dLoss/d(prediction) as a function of the prediction's values
            # (Keras may read a sigmoid/softmax's logits, bypassing y_pred).
            shown = capture.output_values(y_pred)
            shown_loss = tf.reduce_mean(tf.cast(self.loss_fn(y, shown), tf.float32))
        return tape, y_pred, loss, shown, shown_loss

    def _vjp(self, x, y):
        # Forward pass: one tape per part.
        tapes, inputs, outputs = [], [], []
        h = x
        for model in self.models[:-1]:
            with tf.GradientTape() as tape:
                tape.watch(h)
                out = model(h, training=self.training)
            tapes.append(tape)
            inputs.append(h)
            outputs.append(out)
            h = out
        last_tape, _, loss, shown, shown_loss = self._forward_last(h, y)

        # Backward pass: the last part starts from the loss ...
        last = self.models[-1]
        *last_gradients, upstream = last_tape.gradient(
            loss,
            list(last.trainable_variables) + [h],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        received = [last_tape.gradient(shown_loss, shown)]
        gradients = [last_gradients]
        # ... and every part below receives dLoss/d(its output) as output_gradients.
        for i in reversed(range(len(self.models) - 1)):
            received.insert(0, upstream)
            model = self.models[i]
            sources = list(model.trainable_variables) + ([inputs[i]] if i else [])
            result = tapes[i].gradient(
                outputs[i],
                sources,
                output_gradients=upstream,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            if i:
                *result, upstream = result
            gradients.insert(0, result)
        return loss, gradients, received

    def _jacobian(self, x, y):
        # Forward pass with persistent tapes: each part is asked for several Jacobians.
        tapes, inputs, outputs = [], [], []
        h = x
        for model in self.models[:-1]:
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(h)
                out = model(h, training=self.training)
            tapes.append(tape)
            inputs.append(h)
            outputs.append(out)
            h = out
        last_tape, y_pred, loss, shown, shown_loss = self._forward_last(h, y)
        # Keras's cross-entropies read a sigmoid/softmax output's logits: the
        # chain starts there. Through the probabilities the loss's gradient
        # is 0 once one rounds to 0 or 1 (and the Jacobian's is too), and
        # every gradient came out 0 where the loss's were large.
        head = getattr(y_pred, "_keras_logits", None)
        head = y_pred if head is None else head
        tapes.append(last_tape)
        inputs.append(h)
        outputs.append(head)

        # dLoss/d(head) is the only gradient taken directly: a row vector.
        row = tf.reshape(last_tape.gradient(loss, head), [1, -1])
        received, gradients = [], []
        for i in reversed(range(len(self.models))):
            received.insert(0, tf.reshape(row, tf.shape(outputs[i])))
            part = []
            for variable in self.models[i].trainable_variables:
                jacobian = _as_matrix(tapes[i].jacobian(outputs[i], variable), outputs[i])
                part.append(tf.reshape(row @ jacobian, variable.shape))
            gradients.insert(0, part)
            if i:
                row = row @ _as_matrix(tapes[i].jacobian(outputs[i], inputs[i]), outputs[i])
        # What the last part received, as `upstream` documents it (the same as "vjp").
        received[-1] = last_tape.gradient(shown_loss, shown)
        return loss, gradients, received

    def _check_parts(self, x):
        """One eager forward pass, part by part, before the compiled one.

        It builds the parts in order, says in words which part does not take
        what the part below gives (inside the compiled pass, Keras's message
        comes wrapped in the traced graph's), and with `method="jacobian"`
        applies the size guard.
        """
        h = x
        for i, model in enumerate(self.models):
            try:
                capture.ensure_built(model, h)
                out = model(h, training=False)
            except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
                given = "the input `x`" if i == 0 else f"the output of `models[{i - 1}]`"
                found = getattr(h, "shape", type(h).__name__)
                reason = _keras_reason(error)
                raise ValueError(
                    f"`models[{i}]` does not take {given} (shape {found}): {reason}"
                ) from error
            if self.method == "jacobian":
                self._check_jacobian_size(i, model, h, out)
            h = out

    def _check_jacobian_size(self, i, model, h, out):
        """Refuse a part the Jacobian way cannot take, or whose Jacobian is too large."""
        if not tf.is_tensor(out) and not hasattr(out, "shape"):
            raise ValueError(
                f"`method='jacobian'` needs parts that each give one tensor; `models[{i}]` "
                f"gives a {type(out).__name__}. Use `method='vjp'`, which takes parts that "
                "hand over several tensors."
            )
        out_size = int(np.prod(out.shape))
        in_sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
        if i:
            in_sizes.append(int(np.prod(h.shape)))
        largest = out_size * max(in_sizes, default=0)
        if largest > self.max_jacobian_entries:
            raise ValueError(
                f"`method='jacobian'` would build a Jacobian of {largest:,} entries "
                f"for `models[{i}]` ({out_size:,} outputs x {max(in_sizes):,} inputs), "
                f"more than `max_jacobian_entries`={self.max_jacobian_entries:,}. "
                "Use a smaller batch or input, raise `max_jacobian_entries`, or use "
                "`method='vjp'`, which gives the same gradients without Jacobians."
            )


def _keras_reason(error):
    """The line of a Keras call error that says what was wrong (without its ANSI bold)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [
        line
        for line in lines
        if line and not line.startswith(("Exception encountered", "Arguments received", "•"))
    ]
    return lines[0] if lines else type(error).__name__


def _as_matrix(jacobian, output):
    """Flatten a Jacobian of shape output.shape + source.shape to [output size, source size]."""
    return tf.reshape(jacobian, [tf.size(output), -1])


def chain_gradients(
    models,
    x,
    y,
    loss=None,
    method="vjp",
    max_jacobian_entries=DEFAULT_MAX_JACOBIAN_ENTRIES,
):
    """Backpropagate through parts with one `GradientTape` each, chaining their gradients.

    The result equals the gradients of one joint tape over
    `models[-1](...models[0](x))`; the parts only change how the chain rule is
    carried out. That is the gradient of the loss on the prediction, in
    inference mode (BatchNormalization's moving statistics, no Dropout; use
    `ChainedBackprop(training=True)` for a training pass): unlike `fit` and
    `gradflow.snapshot`, it leaves out the parts' regularization losses
    (`kernel_regularizer`, `add_loss`). A part used twice gets two entries,
    each with that use's share of its gradient (their sum is the joint
    tape's).

    Example:

    ```python
    parts = split_cnn(input_shape=(8, 8, 1), seed=0)
    x, y = toy_batch(8, input_shape=(8, 8, 1))
    grads = chain_gradients(parts, x, y, loss="mse")
    [g.shape for g in grads[0]]    # kernel and bias of the first Conv2D
    ```

    Args:
        models: The parts in order, input side first (Keras models or layers).
        x: Inputs of the first part.
        y: Targets for the last part's output.
        loss: A Keras loss object, its name, a callable, or `None` for the last
            part's compiled loss. Defaults to `None`.
        method: `"vjp"` (default): vector-Jacobian products through
            `output_gradients`, compiled. `"jacobian"`: full Jacobians
            multiplied as matrices; slow, for teaching.
        max_jacobian_entries: Size guard for `method="jacobian"`. Defaults to
            20,000,000.

    Returns:
        A `ChainGradients`: `result[i]` is the list of gradients of
        `models[i].trainable_variables`; `result.upstream[i]` is dLoss/d(output
        of part i); `result.loss` the loss.

    Raises:
        TypeError: if `models` is not a list of Keras models.
        ValueError: for an empty `models`, an unknown `method`, a bad loss,
            mismatched batch sizes, or a Jacobian past `max_jacobian_entries`.
    """
    backprop = ChainedBackprop(
        models, loss=loss, method=method, max_jacobian_entries=max_jacobian_entries
    )
    return backprop(x, y)


def split_cnn(input_shape=(8, 8, 1), filters=4, seed=0):
    """The teaching model: a small CNN cut into three parts.

    Part 1 is `Conv2D(filters, 3, relu)`, part 2 another `Conv2D(filters, 3,
    relu)`, part 3 `Flatten` then `Dense(1, sigmoid)`; it is trained with MSE.
    Weights are seeded, so the same arguments give the same model.

    Example:

    >>> parts = split_cnn(input_shape=(8, 8, 1), seed=0)
    >>> [p.name for p in parts]
    ['part_1_conv', 'part_2_conv', 'part_3_head']

    Args:
        input_shape: Shape of one image, `(height, width, channels)`, each
            side at least 5. Defaults to `(8, 8, 1)`.
        filters: Filters of each Conv2D. Defaults to 4.
        seed: Seed of the weight initializers. Defaults to 0.

    Returns:
        A list of three built `keras.Sequential` models.

    Raises:
        ValueError: if `input_shape` is not 3 positive sizes with sides >= 5.
    """
    shape = tuple(input_shape)
    if len(shape) != 3 or any(int(s) != s or s < 1 for s in shape) or min(shape[:2]) < 5:
        raise ValueError(
            "`input_shape` must be (height, width, channels) with height and width "
            f"at least 5 (two 3x3 convolutions), got {input_shape!r}."
        )
    filters = positive_int("filters", filters)

    # Float32 and channels-last whatever the global Keras config (keras.json,
    # `set_floatx`, `set_image_data_format`): the lesson's numbers and shapes.
    def conv(offset):
        return keras.layers.Conv2D(
            filters,
            3,
            activation="relu",
            kernel_initializer=keras.initializers.HeNormal(seed=seed + offset),
            bias_initializer=keras.initializers.Constant(0.01),
            data_format="channels_last",
            dtype="float32",
        )

    def start(shape):
        return keras.Input(shape, dtype="float32")

    first = keras.Sequential([start(shape), conv(0)], name="part_1_conv")
    second = keras.Sequential([start(first.output_shape[1:]), conv(1)], name="part_2_conv")
    head = keras.Sequential(
        [
            start(second.output_shape[1:]),
            keras.layers.Flatten(data_format="channels_last", dtype="float32"),
            keras.layers.Dense(
                1,
                activation="sigmoid",
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2),
                dtype="float32",
            ),
        ],
        name="part_3_head",
    )
    return [first, second, head]


def toy_batch(batch_size=8, input_shape=(8, 8, 1), seed=0):
    """A small random batch for `split_cnn`: images in [0, 1) and 0/1 targets.

    Args:
        batch_size: Number of samples. Defaults to 8.
        input_shape: Shape of one image. Defaults to `(8, 8, 1)`.
        seed: Seed of the numpy generator. Defaults to 0.

    Returns:
        A tuple `(x, y)` of float32 arrays, shapes `(batch_size, *input_shape)`
        and `(batch_size, 1)`.
    """
    batch_size = positive_int("batch_size", batch_size)
    rng = np.random.default_rng(seed)
    x = rng.random((batch_size, *input_shape), dtype=np.float32)
    y = (x.mean(axis=tuple(range(1, x.ndim))) > 0.5).astype(np.float32)[:, None]
    return x, y
