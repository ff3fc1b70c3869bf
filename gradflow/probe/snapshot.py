"""Per-layer gradient statistics of any Keras model on one batch.

`snapshot(model, x, y)` answers the practitioner's first questions without
training: how large is each layer's weight gradient, how large is the
gradient of the loss with respect to each layer's output, and how sensitive
is each layer's output to the input. Nothing is updated: no optimizer step,
and the forward pass runs with `training=False` by default so that Dropout is
off and BatchNormalization neither uses batch statistics nor moves its moving
mean and variance. With `training=True` the pass behaves as in `fit`, and the
moving statistics (and Dropout's seed state) are restored afterwards; so are,
in either mode, a stateful RNN's carried state and any non-trainable weight a
custom layer assigns in `call`.

Everything (forward pass, loss, weight and activation gradients, input
sensitivity, statistics) runs in one compiled `tf.function`. `GradientProbe`
keeps that function for repeated use on many batches.
"""

import dataclasses
import functools
import re

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from gradflow import schema
from gradflow.checks import check_backend, check_not_legacy, flag
from gradflow.probe import capture, sensitivity
from gradflow.probe.labels import label_problem
from gradflow.probe.naming import layer_order, split_overwritten, variable_names
from gradflow.statistics import summarize, zeros_where_missing

_KEY_COLUMNS = ["step", "layer", "layer_index", "tensor", "variable", "shape"]
_BIN_COLUMNS = [f"b{i}" for i in range(schema.HISTOGRAM_BINS)]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The gradients of one batch, as tidy pandas tables.

    Attributes:
        weights: One row per trainable variable: `step` (always 0), `layer`,
            `layer_index` (0 nearest the input), `tensor` (`kernel`, `bias`,
            ...), `variable` (Keras `Variable.path`), `shape`, then the
            statistics of `gradflow.schema.STATISTICS` of dLoss/d(variable).
            A variable no gradient reaches has no row (see `no_gradient`).
        activations: One row per layer call in the forward pass (leaf layers,
            nested ones as `outer/inner`, a second call of a shared layer as
            `path#2`), in call order: the statistics of dLoss/d(layer output),
            `tensor` = `"activation"`, `variable` = `""`. For the model's
            output this is the derivative of the loss as a function of the
            output values, also where Keras computes a cross-entropy from a
            softmax's logits. A layer called inside `keras.remat` has no
            row (and is not in `no_gradient`): the tape does not record
            what runs there, so its output's gradient cannot be read; its
            weights have their rows, and its `inputs` row a NaN.
        inputs: One row per layer call: `layer`, `layer_index`, `max_abs` of
            d(sum of the layer's output)/d(model input). For integer inputs
            `max_abs` is NaN and a `note` column says why.
        loss: The scalar loss of the batch (batch mean, plus the model's
            regularization losses).
        histograms: Counts of log10|g| in the fixed bins of `gradflow.schema`,
            one row per row of `weights` and of `activations` (columns
            `layer`, `layer_index`, `tensor`, `variable`, `b0`...). Empty when
            histograms were not asked for.
        training: The `training` flag the forward pass ran with.
        no_gradient: `{layer: (tensor, ...)}` of the weights and layer outputs
            (`"output"`) that no gradient reaches: the loss does not depend on
            them. They have no rows above; zeros there would read as
            vanishing gradients. `gradflow.diagnosis.no_gradient_message`
            says it in words.
        layer_inputs: `{layer call: the recorded call whose output it reads}`,
            None where the two are not compared (see `gradflow.diagnose`'s
            `layer_inputs`).
    """

    weights: pd.DataFrame = dataclasses.field(repr=False)
    activations: pd.DataFrame = dataclasses.field(repr=False)
    inputs: pd.DataFrame = dataclasses.field(repr=False)
    loss: float
    histograms: pd.DataFrame = dataclasses.field(repr=False)
    training: bool = False
    no_gradient: dict = dataclasses.field(default_factory=dict)
    layer_inputs: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def layer_stats(self):
        """`weights` and `activations` stacked in gradflow's tidy layout.

        Carries `layer_inputs` in `attrs`, for `gradflow.diagnose`.
        """
        columns = [c for c in schema.LAYER_STATS_COLUMNS if c in self.weights.columns]
        table = pd.concat([self.weights[columns], self.activations[columns]], ignore_index=True)
        if self.layer_inputs:
            table.attrs["layer_inputs"] = dict(self.layer_inputs)
        return table


def resolve_loss(model, loss, argument="loss"):
    """Turn `loss` (object, name, callable or None) into a callable.

    `argument` is the name the messages give it (`probe_loss` for the
    monitor's probe).

    Raises:
        ValueError: if `loss` is None and the model has no compiled loss, if
            the name is unknown, or if the loss is per-output (list/dict).
        TypeError: if `loss` is neither a string nor callable.
    """
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                f"`{argument}` is None and the model was not compiled with a loss. Pass "
                f"`{argument}=` (a Keras loss object such as keras.losses.MeanSquaredError(), "
                "or its name such as 'mse' or 'sparse_categorical_crossentropy'), "
                "or call `model.compile(loss=...)` first."
            )
    if isinstance(loss, type) and issubclass(loss, keras.losses.Loss):
        raise TypeError(
            f"`{argument}` is the class keras.losses.{loss.__name__}; pass one of its "
            f"objects: keras.losses.{loss.__name__}()."
        )
    if isinstance(loss, (list, tuple, dict)) and len(loss) == 1:
        # A model of one output compiled with `loss={"logits": ...}`.
        (loss,) = loss.values() if isinstance(loss, dict) else loss
        return resolve_loss(model, loss, argument)
    if isinstance(loss, (list, tuple, dict)):
        # Plain types for the message: a compiled model's dict of losses is a
        # TensorFlow tracking wrapper ("_DictWrapper").
        shown = dict(loss) if isinstance(loss, dict) else list(loss)
        raise ValueError(
            f"gradflow probes models with one output: `{argument}` must be one loss, got a "
            f"{type(shown).__name__} of losses, one per output ({shown!r}). Build a model of "
            "the input "
            "and the one output you want to study, e.g. keras.Model(model.input, "
            "model.outputs[0]), and give that output's loss."
        )
    if isinstance(loss, str):
        try:
            return loss_object(keras.losses.get(loss))
        except ValueError:
            raise ValueError(
                f"Unknown loss name `{argument}`={loss!r}. Use a Keras loss name such as "
                "'mse', 'mae', 'binary_crossentropy', 'categorical_crossentropy' or "
                "'sparse_categorical_crossentropy', or pass a keras.losses.Loss."
            ) from None
    if not callable(loss):
        raise TypeError(
            f"`{argument}` must be a Keras loss object, a loss name, a callable "
            f"(y_true, y_pred) or None; got {type(loss).__name__}: {loss!r}."
        )
    return loss


@functools.cache
def _loss_classes():
    """Keras's built-in loss functions -> the loss class that wraps each."""
    found = {}
    for name in dir(keras.losses):
        kind = getattr(keras.losses, name)
        if isinstance(kind, type) and issubclass(kind, keras.losses.Loss):
            try:
                function = kind().fn
            except Exception:  # Loss itself, or a class that needs arguments.
                continue
            found.setdefault(function, kind)
    return found


def loss_object(function):
    """The loss class of a built-in loss function (`binary_crossentropy` -> `BinaryCrossentropy()`).

    `keras.losses.get("binary_crossentropy")` gives the bare function, which
    refuses labels of shape `(n,)` for an output of shape `(n, 1)` ("target
    and output must have the same rank"); `compile` and `fit` accept them,
    because the class brings the two to one rank first. Anything else is
    returned as it is.
    """
    kind = _loss_classes().get(function) if callable(function) else None
    return function if kind is None else kind()


# What TensorFlow accepts in the name scopes Keras opens with a model's and
# its layers' names (`tensorflow/python/framework/ops.py`).
_ROOT_SCOPE = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*")
_INNER_SCOPE = re.compile(r"[A-Za-z0-9_.\\/>-]*")


def check_probe_model(model):
    """Refuse, in words, what the probe cannot differentiate: odd names, several outputs.

    A model or layer named "my model!" made TensorFlow fail with "is not a
    valid root scope name" deep inside the traced pass (which Keras's own
    `fit` does too), and left Keras's name scope open, so that every model
    built after it in the thread had its variables under that name.
    """
    for layer in [model, *(layer for _, layer in capture.leaf_layers(model))]:
        if not (_ROOT_SCOPE if layer is model else _INNER_SCOPE).fullmatch(layer.name):
            what = "model" if layer is model else "layer"
            raise ValueError(
                f"The {what} name {layer.name!r} cannot be used by TensorFlow (nor by Keras's "
                "own `fit`): names may hold letters, digits and . _ - / > only, and must start "
                f"with a letter, a digit or a dot. Rename the {what} (and save the model again)."
            )
    outputs = getattr(model, "outputs", None)
    if outputs is not None and len(outputs) > 1:
        raise _several_outputs(model, len(outputs))


def _several_outputs(model, count):
    names = getattr(model, "output_names", None) or []
    listed = f" ({', '.join(repr(name) for name in names)})" if len(names) == count else ""
    return ValueError(
        f"gradflow probes models with one output; this model has {count}{listed}. Build a "
        "model of the input and the one output you want to study, e.g. "
        "keras.Model(model.input, model.outputs[0]), and probe that."
    )


def check_batch_sizes(x, y):
    """Raise a ValueError naming the shapes if `x` or `y` is empty or they disagree on the batch."""
    sizes = {}
    for name, data in (("x", x), ("y", y)):
        for tensor in tf.nest.flatten(data):
            if tensor.shape.rank == 0:
                raise ValueError(f"`{name}` must have a batch dimension, got a scalar {tensor}.")
            if tensor.shape[0] == 0:
                # The mean loss of no samples is NaN, and every gradient 0.
                raise ValueError(
                    f"`{name}` holds no samples (shape {tuple(tensor.shape)}); give at least one."
                )
            sizes.setdefault(tensor.shape[0], (name, tuple(tensor.shape)))
    if len(sizes) > 1:
        seen = ", ".join(f"`{n}` of shape {s}" for n, s in sizes.values())
        raise ValueError(
            f"`x` and `y` must hold the same number of samples (first dimension), got {seen}."
        )


def check_input_shape(model, x):
    """Raise a ValueError naming both shapes if `x` cannot be the input of `model`.

    Only for a model with one declared input (Sequential or Functional);
    Keras's own error comes from inside the traced graph, wrapped in a
    traceback of its source lines.
    """
    try:
        declared = tf.nest.flatten(model.inputs)  # a subclassed model has none
    except (AttributeError, ValueError):
        return
    if len(declared) == 1 and isinstance(x, (list, tuple)) and len(x) > 1:
        raise ValueError(
            f"`x` is a {type(x).__name__} of {len(x)} arrays, but model {model.name!r} takes "
            "one input: pass one array."
        )
    if len(declared) != 1 or not isinstance(x, tf.Tensor):
        return
    expected = tuple(declared[0].shape)
    given = tuple(x.shape)
    fits = len(given) == len(expected) and all(
        e is None or e == g for e, g in zip(expected[1:], given[1:], strict=True)
    )
    if not fits:
        per_sample = expected[1:]
        raise ValueError(
            f"`x` has shape {given}, but model {model.name!r} takes inputs of shape "
            f"(batch, {', '.join('any' if d is None else str(d) for d in per_sample)}): "
            f"{_per_sample_words(given[1:])} against {_per_sample_words(per_sample)}."
        )


def _per_sample_words(shape):
    if len(shape) == 1:
        return f"{'any number of' if shape[0] is None else shape[0]} features a sample"
    return f"samples of shape {shape}"


def _mean_loss(loss_fn, y, y_pred):
    if isinstance(y_pred, (dict, list, tuple)) and len(y_pred) == 1:
        # One output in a dict or list (`{"logits": ...}`): its loss reads the tensor.
        (y_pred,) = y_pred.values() if isinstance(y_pred, dict) else y_pred
    value = loss_fn(y, y_pred)
    # Plain Keras loss functions ("mse") return one value per sample; the
    # training loss is their batch mean (Keras's "sum_over_batch_size").
    return tf.reduce_mean(tf.cast(value, tf.float32))


class GradientProbe:
    """A compiled snapshot function for one model and loss, reusable across batches.

    The first call traces the forward and backward pass into one graph; later
    calls with batches of the same shape only run it. `snapshot()` is the
    one-shot form.

    Example:

    ```python
    probe = GradientProbe(model, loss="sparse_categorical_crossentropy")
    for x_batch, y_batch in batches:
        print(probe(x_batch, y_batch).weights[["layer", "l2_norm"]])
    ```

    Args:
        model: A Keras model: Sequential, Functional, subclassed (also never
            called symbolically), nested, recurrent or convolutional.
        loss: A Keras loss object, its string name, a callable
            `(y_true, y_pred)`, or `None` for the model's compiled loss.
            Defaults to `None`.
        training: Forward pass in training mode. Defaults to `False`.
        histograms: Whether to also count log10|g| histograms. Defaults to
            `True`.
        sensitivity: Whether to compute the input sensitivity table (one
            backward graph per layer). Defaults to `True`.

    Raises:
        ValueError: if `loss` is None and the model is not compiled (see
            `resolve_loss`), or a switch is not True or False.
        TypeError: if `model` is not a Keras model.
    """

    def __init__(self, model, loss=None, training=False, histograms=True, sensitivity=True):
        check_backend("gradflow.snapshot")
        check_not_legacy("model", model)
        self.model = capture.check_model(model)
        self.loss_fn = resolve_loss(model, loss)
        self.training = flag("training", training)
        self.histograms = flag("histograms", histograms)
        self.sensitivity = flag("sensitivity", sensitivity)
        # Python-side layout of each traced graph, keyed by the input signature.
        self._layouts = {}
        self._last_layout = None
        self._compiled = tf.function(self._gradients)

    def _gradients(self, x, y):
        model = self.model
        inputs = sensitivity.differentiable_inputs(x)
        sensitive = self.sensitivity and bool(inputs)
        # Forward pass
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(inputs)
            with capture.record_layer_outputs(model) as outputs:
                y_pred = model(x, training=self.training)
            if len(tf.nest.flatten(y_pred)) > 1:  # a subclassed model has no `outputs` before
                raise _several_outputs(model, len(tf.nest.flatten(y_pred)))
            loss = _mean_loss(self.loss_fn, y, y_pred)
            if model.losses:
                loss += tf.add_n(
                    [tf.cast(tf.reduce_sum(extra), tf.float32) for extra in model.losses]
                )
            # Keras's cross-entropies read a softmax/sigmoid output's logits
            # directly (for stability), which leaves the output tensor itself
            # off the gradient path. The same loss on a copy of the output
            # values gives dLoss/d(output) as a student would define it.
            shown = [capture.output_values(t) for t in tf.nest.flatten(y_pred)]
            shown_loss = _mean_loss(self.loss_fn, y, tf.nest.pack_sequence_as(y_pred, shown))
        # Compute gradients
        # Not float8's scales and amax histories, whose "gradient" is a new value.
        variables, _ = split_overwritten(model.trainable_variables)
        gradients = tape.gradient(
            loss, variables + outputs.tensors + [t for row in outputs.others for t in row]
        )
        tensors, gradients[len(variables) :] = capture.reached_outputs(
            outputs.tensors, outputs.others, gradients[len(variables) :]
        )
        sources = variables + tensors
        final = tape.gradient(shown_loss, shown)
        for i, tensor in enumerate(tensors):
            for output, gradient in zip(tf.nest.flatten(y_pred), final, strict=True):
                if tensor is output and gradient is not None:
                    gradients[len(variables) + i] = gradient
        # None: the loss does not depend on it. Summarized as zeros, its row
        # is dropped from the tables (`_tables`).
        unreached = [i for i, g in enumerate(gradients) if g is None]
        gradients = zeros_where_missing(gradients, sources)
        # Record gradient statistics
        statistics, histograms = summarize(gradients, histogram=self.histograms)
        maxima = (
            sensitivity.sensitivity_maxima(tape, tensors, inputs, outputs.untaped)
            if sensitive
            else tf.fill([len(outputs)], float("nan"))
        )
        # Runs while tracing only: the Python side of the graph's layout.
        self._layouts[_signature(x, y)] = self._last_layout = {
            "paths": list(outputs.paths),
            # The saturation rule's pairs, as the monitor keeps them (`StepPlan.activation_inputs`).
            "layer_inputs": dict(zip(outputs.paths, outputs.compared_inputs(), strict=True)),
            "shapes": [tuple(t.shape) for t in tensors],
            "variables": variables,
            # Outputs made inside `keras.remat` have no gradient to read, but
            # the loss reaches them: no row, and not "no gradient".
            "unreached": unreached,
            "untaped": [len(variables) + i for i, u in enumerate(outputs.untaped) if u],
            "inputs_note": (
                sensitivity.INTEGER_INPUT_NOTE
                if not inputs
                else ("" if self.sensitivity else "not computed (sensitivity=False)")
            ),
        }
        return loss, statistics, histograms, maxima

    def __call__(self, x, y):
        """Compute the snapshot of one batch.

        Args:
            x: Inputs: numpy array, tensor, or a list/dict of them.
            y: Targets with the same number of samples as `x`.

        Returns:
            A `Snapshot`.

        Raises:
            ValueError: if `x` and `y` hold different numbers of samples, or
                no samples, or `x` does not fit the model's input shape.
            TypeError: if `x` or `y` is not array-like.
        """
        x = sensitivity.to_tensors(x, "x")
        y = sensitivity.to_tensors(y, "y")
        check_batch_sizes(x, y)
        check_input_shape(self.model, x)
        check_probe_model(self.model)
        # Restored in inference mode too: a stateful RNN's carried state and a
        # custom layer's counters move in any forward pass.
        with sensitivity.restored_state(self.model):
            capture.ensure_built(self.model, x)
            problem = label_problem(self.model, self.loss_fn, y)
            if problem:
                raise ValueError(f"`y` does not fit the loss: {problem}")
            loss, statistics, histograms, maxima = self._compiled(x, y)
        # A relaxed (None-sized) trace has no exact key; its layout is the last one.
        layout = self._layouts.get(_signature(x, y), self._last_layout)
        return self._tables(layout, loss, statistics, histograms, maxima)

    def _layout(self, traced):
        """Key columns of every row, built once per trace (they do not change between calls)."""
        if traced.get("keys") is None:
            variables = traced["variables"]
            paths = traced["paths"]
            names = variable_names(self.model, variables, called=paths)
            index = {path: i for i, path in enumerate(layer_order(self.model, called=paths))}
            traced["keys"] = pd.DataFrame(
                {
                    "step": np.zeros(len(names) + len(paths), np.int64),
                    "layer": [n.layer for n in names] + paths,
                    "layer_index": [n.layer_index for n in names]
                    + [index[p.split("#")[0]] for p in paths],
                    "tensor": [n.tensor for n in names] + [schema.ACTIVATION] * len(paths),
                    "variable": [n.variable for n in names] + [""] * len(paths),
                    "shape": [tuple(v.shape) for v in variables] + traced["shapes"],
                },
                columns=_KEY_COLUMNS,
            )
        return traced["keys"]

    def _tables(self, traced, loss, statistics, histograms, maxima):
        keys = self._layout(traced)
        values = pd.DataFrame(
            statistics.numpy().astype(np.float64), columns=list(schema.STATISTICS)
        )
        values["nonfinite"] = values["nonfinite"].astype(np.int64)
        table = pd.concat([keys, values], axis=1)
        n = len(traced["variables"])
        note = traced["inputs_note"]
        inputs = sensitivity.sensitivity_table(
            self.model,
            traced["paths"],
            maxima.numpy().astype(np.float64),
            note=note,
            training=self.training,
        )
        histogram_keys = keys[["layer", "layer_index", "tensor", "variable"]]
        if histograms is None:
            histogram_keys = histogram_keys.iloc[:0]
            counts = np.zeros((0, len(_BIN_COLUMNS)), np.int64)
        else:
            counts = histograms.numpy().astype(np.int64)
        counts = pd.concat([histogram_keys, pd.DataFrame(counts, columns=_BIN_COLUMNS)], axis=1)
        unreached = traced["unreached"]
        no_gradient = {}
        untaped = set(traced.get("untaped", ()))
        for row in unreached:
            if row in untaped:
                continue
            tensor = keys["tensor"].iloc[row] if row < n else "output"
            no_gradient.setdefault(keys["layer"].iloc[row], []).append(tensor)
        table = table.drop(index=unreached)
        counts = counts.drop(index=[row for row in unreached if row < len(counts)])
        return Snapshot(
            weights=table[table.index < n].reset_index(drop=True),
            activations=table[table.index >= n].reset_index(drop=True),
            inputs=inputs,
            loss=float(loss),
            histograms=counts.reset_index(drop=True),
            training=self.training,
            no_gradient={layer: tuple(tensors) for layer, tensors in no_gradient.items()},
            layer_inputs=dict(traced["layer_inputs"]),
        )


def _signature(x, y):
    """What makes `tf.function` trace anew: the shapes and dtypes of the inputs."""
    return tuple((tuple(t.shape), t.dtype.name) for t in tf.nest.flatten((x, y)))


def snapshot(model, x, y, loss=None, training=False, histograms=True, sensitivity=True):
    """Per-layer gradient statistics of `model` on one batch, without updating it.

    Example:

    ```python
    import gradflow
    shot = gradflow.snapshot(model, x_batch, y_batch, loss="mse")
    shot.weights[["layer", "tensor", "max_abs", "l2_norm"]]
    shot.activations[["layer", "l2_norm", "zero_fraction"]]
    shot.inputs        # max |d(sum of layer output)/d input| per layer
    ```

    Args:
        model: A Keras model: Sequential, Functional, subclassed (also never
            called symbolically), nested, recurrent or convolutional.
        x: One batch of inputs: numpy array, tensor, or a list/dict of them.
            Float64 arrays are cast to `keras.backend.floatx()`, as in `fit`.
        y: The targets of that batch.
        loss: A Keras loss object (`keras.losses.MeanSquaredError()`), its
            string name (`"mse"`, `"sparse_categorical_crossentropy"`), a
            callable `(y_true, y_pred)`, or `None` to use the loss the model
            was compiled with. Defaults to `None`. The model's regularization
            losses (`model.losses`) are added, as in training.
        training: Run the forward pass in training mode. Defaults to `False`:
            Dropout is off and BatchNormalization uses its moving statistics,
            so the result is deterministic. With `True` the pass matches a
            `fit` step (batch statistics, random Dropout masks); the moving
            statistics and seed state are restored afterwards.
        histograms: Also count log10|g| histograms. Defaults to `True`.
        sensitivity: Also compute `.inputs` (one extra backward graph per
            layer, which is most of the tracing time of a deep model: 38 s
            against 3 s for MobileNetV2's 155 layers on a 2-core CPU).
            Defaults to `True`; with `False`, `.inputs["max_abs"]` is NaN.

    Each call traces its graphs anew. For many batches, make one
    `GradientProbe(model, ...)` and call it on each: it traces once per
    input shape.

    Returns:
        A `Snapshot` with `.weights`, `.activations`, `.inputs`, `.loss` and
        `.histograms`. No variable of the model is changed, nor a stateful
        RNN's carried state.

    Raises:
        ValueError: if `loss` is None and the model is not compiled, if the
            loss name is unknown, or if `x` and `y` hold different numbers of
            samples, or no samples.
        TypeError: if `model` is not a Keras model, `x` or `y` is not
            array-like, or `loss` not callable.
    """
    probe = GradientProbe(
        model, loss=loss, training=training, histograms=histograms, sensitivity=sensitivity
    )
    return probe(x, y)
