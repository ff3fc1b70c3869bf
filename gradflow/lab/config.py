"""`RunConfig`: everything that defines one training run of the lab, validated.

This module imports neither TensorFlow nor Streamlit: the dashboard validates
its widgets with `RunConfig` before any worker process starts, and the command
line builds its flags from the same field table.

Choices use Keras's own identifiers (`"relu"`, `"he_normal"`, `"adam"`,
`"sparse_categorical_crossentropy"`), so what a user knows from Keras works.

Example:

```python
from gradflow.lab.config import RunConfig

config = RunConfig(depth=10, activation="sigmoid", steps=300)
config.to_query()            # {"depth": "10", "activation": "sigmoid"}
RunConfig.from_query(config.to_query()) == config   # True
config.replace(activation="relu", initializer="he_normal")
```
"""

import dataclasses
import json
import math
import numbers
import re

ARCHITECTURES = ("mlp", "cnn", "rnn", "residual_mlp")
ACTIVATIONS = (
    "relu",
    "leaky_relu",
    "elu",
    "selu",
    "gelu",
    "swish",
    "tanh",
    "sigmoid",
    "linear",
)
INITIALIZERS = (
    "glorot_uniform",
    "glorot_normal",
    "he_uniform",
    "he_normal",
    "lecun_uniform",
    "lecun_normal",
    "random_normal",
)
NORMALIZATIONS = ("none", "batch", "layer")
RNN_CELLS = ("simple_rnn", "lstm", "gru")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "rmsprop", "adam", "adamw", "adagrad", "nadam")
CLIPPINGS = ("none", "value", "norm", "global_norm")
LOSSES = (
    "auto",
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "mse",
    "mae",
    "binary_crossentropy",
    "huber",
)
DATASETS = (
    "digits",
    "spirals",
    "circles",
    "moons",
    "xor",
    "gaussians",
    "regression",
    "adding",
    "mnist",
    "fashion_mnist",
    "cifar10",
    "file",
)

# What each built-in data set is, so that impossible combinations fail here,
# in the dashboard, before a worker loads data or builds a model. A user's
# file can be anything; it is checked when it is loaded.
IMAGE_DATASETS = ("digits", "mnist", "fashion_mnist", "cifar10")
# Images are read row by row by a recurrent network (digits: 8 steps x 8).
SEQUENCE_DATASETS = IMAGE_DATASETS + ("adding",)
REGRESSION_DATASETS = ("regression", "adding")
BINARY_DATASETS = ("circles", "moons", "xor")
DOWNLOADED_DATASETS = ("mnist", "fashion_mnist", "cifar10")
CROSSENTROPY_LOSSES = (
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
)

# High enough for the "divergence" lecture demo (SGD at 10 or 100 blows up
# within a few steps), low enough to catch a typo such as 1e9.
MAX_LEARNING_RATE = 1e4


def _choice(default, choices, help):
    return dataclasses.field(
        default=default, metadata={"kind": "choice", "choices": choices, "help": help}
    )


def _integer(default, low, high, help, optional=False):
    return dataclasses.field(
        default=default,
        metadata={"kind": "int", "low": low, "high": high, "optional": optional, "help": help},
    )


def _number(default, low, high, help, optional=False, low_open=True):
    return dataclasses.field(
        default=default,
        metadata={
            "kind": "float",
            "low": low,
            "high": high,
            "low_open": low_open,
            "optional": optional,
            "help": help,
        },
    )


def _flag(default, help):
    return dataclasses.field(default=default, metadata={"kind": "bool", "help": help})


def _text(default, help, max_length=500):
    return dataclasses.field(
        default=default,
        metadata={"kind": "str", "optional": True, "max_length": max_length, "help": help},
    )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run of the gradflow lab: model, optimizer, data, recording.

    Every field is checked when the config is made; an invalid value raises a
    `ValueError` that names the field, shows the value and says what is
    allowed. The defaults train a 4-layer ReLU MLP on the bundled digits data
    for 300 SGD steps: a few seconds on a laptop CPU, with visible learning.

    Example:

    ```python
    config = RunConfig(depth=12, activation="sigmoid")
    RunConfig(depth=0)
    # ValueError: `depth` must be an integer from 1 to 100, got 0.
    ```

    Args:
        architecture: `"mlp"`, `"cnn"`, `"rnn"` or `"residual_mlp"` (an MLP
            with a skip connection around every hidden layer; the same as
            `"mlp"` with `residual=True`). Defaults to `"mlp"`.
        depth: Number of hidden layers (Dense, Conv2D or recurrent), 1-100.
            Defaults to 4.
        width: Units (or filters) per hidden layer, 1-1024. Defaults to 32.
        activation: Keras activation of the hidden layers (for `rnn`, of the
            recurrent cell). Defaults to `"relu"`.
        initializer: Keras kernel initializer. Defaults to `"glorot_uniform"`.
        init_stddev: Standard deviation for `initializer="random_normal"`:
            small (0.01) shows vanishing, large (1.0) exploding gradients.
            Defaults to 0.05 (the Keras default).
        normalization: `"none"`, `"batch"` or `"layer"` after each hidden
            layer. Defaults to `"none"`.
        dropout: Dropout rate after each hidden layer, 0-0.9. Defaults to 0.
        residual: Skip connections around each hidden layer (a projection
            where the width changes). Defaults to False.
        rnn_cell: `"simple_rnn"`, `"lstm"` or `"gru"` for `architecture="rnn"`.
            Defaults to `"simple_rnn"`.
        optimizer: `"sgd"`, `"momentum"` (SGD, momentum 0.9), `"nesterov"`,
            `"rmsprop"`, `"adam"`, `"adamw"`, `"adagrad"` or `"nadam"`.
            Defaults to `"sgd"`.
        learning_rate: Greater than 0, at most 1e4 (huge rates are allowed on
            purpose, to show divergence). Defaults to 0.05.
        batch_size: 1-4096. Defaults to 32.
        steps: Optimizer updates to run, 1-1,000,000. Defaults to 300.
        epochs: If set (1-10,000), train this many passes over the training
            data instead of `steps`. Defaults to None.
        clipping: `"none"`, `"value"` (Keras `clipvalue`), `"norm"`
            (`clipnorm`, per variable) or `"global_norm"` (`global_clipnorm`).
            Defaults to `"none"`.
        clip_value: The threshold for `clipping`, greater than 0. Defaults to 1.
        max_norm: If set, a `keras.constraints.MaxNorm` on every kernel.
            Defaults to None.
        loss: `"auto"` (sparse categorical cross-entropy with a softmax output
            for classification, mean squared error for regression) or one of
            Keras's loss identifiers `"sparse_categorical_crossentropy"`,
            `"categorical_crossentropy"`, `"mse"`, `"mae"`,
            `"binary_crossentropy"`, `"huber"`. Defaults to `"auto"`.
        dataset: A built-in data set or `"file"` (with `data_path`). Defaults
            to `"digits"`, bundled with scikit-learn (no download).
        data_path: An `.npz` or `.csv` file for `dataset="file"`.
        n_samples: Size of the synthetic data sets (spirals, circles, moons,
            xor, gaussians, regression, adding), 10-1,000,000. Defaults to 1000.
        sequence_length: Time steps of the adding problem, 2-1000. Defaults
            to 50.
        seed: Seeds data, initial weights and shuffling, 0-2**31-1.
            Defaults to 0.
        record_every: Record gradient statistics every this many steps.
            Defaults to 1.
        histograms: Also record histograms of log10|gradient|. Defaults to
            False.
        activations: Also record gradients w.r.t. each layer's output.
            Defaults to False.
        pace: At most this many steps a second (above 0, at most 10,000),
            to watch a run live in class; the command line's `--pace`.
            Defaults to None: full speed.
        name: A name for the run, or None for an automatic one.

    Raises:
        ValueError: If a field has the wrong type or is out of range, if
            fields contradict each other (`architecture="cnn"` on a 2-D data
            set, `dataset="adding"` without `architecture="rnn"`, ...).
    """

    architecture: str = _choice("mlp", ARCHITECTURES, "network family")
    depth: int = _integer(4, 1, 100, "number of hidden layers")
    width: int = _integer(32, 1, 1024, "units or filters per hidden layer")
    activation: str = _choice("relu", ACTIVATIONS, "Keras activation of hidden layers")
    initializer: str = _choice("glorot_uniform", INITIALIZERS, "Keras kernel initializer")
    init_stddev: float = _number(0.05, 0.0, 100.0, "stddev for initializer=random_normal")
    normalization: str = _choice("none", NORMALIZATIONS, "normalization after hidden layers")
    dropout: float = _number(0.0, 0.0, 0.9, "dropout rate", low_open=False)
    residual: bool = _flag(False, "skip connections around hidden layers")
    rnn_cell: str = _choice("simple_rnn", RNN_CELLS, "recurrent cell for architecture=rnn")
    optimizer: str = _choice("sgd", OPTIMIZERS, "optimizer")
    learning_rate: float = _number(0.05, 0.0, MAX_LEARNING_RATE, "learning rate")
    batch_size: int = _integer(32, 1, 4096, "mini-batch size")
    steps: int = _integer(300, 1, 1_000_000, "optimizer steps (ignored when epochs is set)")
    epochs: int | None = _integer(None, 1, 10_000, "epochs; wins over steps", optional=True)
    clipping: str = _choice("none", CLIPPINGS, "gradient clipping in the optimizer")
    clip_value: float = _number(1.0, 0.0, 1e6, "threshold for clipping")
    max_norm: float | None = _number(None, 0.0, 1e6, "MaxNorm constraint on kernels", optional=True)
    loss: str = _choice("auto", LOSSES, "Keras loss identifier, or auto")
    dataset: str = _choice("digits", DATASETS, "data set")
    data_path: str | None = _text(None, ".npz or .csv file for dataset=file", max_length=4096)
    n_samples: int = _integer(1000, 10, 1_000_000, "size of synthetic data sets")
    sequence_length: int = _integer(50, 2, 1000, "time steps of the adding problem")
    seed: int = _integer(0, 0, 2**31 - 1, "random seed")
    record_every: int = _integer(1, 1, 1_000_000, "record statistics every N steps")
    histograms: bool = _flag(False, "record gradient histograms")
    activations: bool = _flag(False, "record activation gradients")
    pace: float | None = _number(
        None,
        0.0,
        10_000.0,
        "at most this many steps a second, to watch a run live in class (None: full speed)",
        optional=True,
    )
    name: str | None = _text(None, "run name", max_length=200)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = _check_field(field, getattr(self, field.name))
            object.__setattr__(self, field.name, value)
        self._check_combination()

    def _check_combination(self):
        if self.architecture == "cnn" and self.dataset not in IMAGE_DATASETS + ("file",):
            raise ValueError(
                f"`architecture='cnn'` needs an image data set ({_listing(IMAGE_DATASETS)} "
                f"or file), got dataset={self.dataset!r}."
            )
        if self.architecture == "rnn" and self.dataset not in SEQUENCE_DATASETS + ("file",):
            raise ValueError(
                f"`architecture='rnn'` needs a sequence or image data set "
                f"({_listing(SEQUENCE_DATASETS)} or file), got dataset={self.dataset!r}."
            )
        if self.dataset == "adding" and self.architecture != "rnn":
            raise ValueError(
                "`dataset='adding'` is a sequence task and needs architecture='rnn', "
                f"got architecture={self.architecture!r}."
            )
        if self.epochs is None and self.record_every > self.steps:
            raise ValueError(
                f"`record_every`={self.record_every} is more than `steps`={self.steps}: no step "
                f"would be recorded. Use a number from 1 to {self.steps}."
            )
        if self.dataset == "file" and not self.data_path:
            raise ValueError("`dataset='file'` needs `data_path` (an .npz or .csv file), got None.")
        if self.dataset != "file" and self.data_path:
            raise ValueError(
                f"`data_path` is only used with dataset='file', got dataset={self.dataset!r} "
                f"and data_path={self.data_path!r}."
            )
        if self.dataset in REGRESSION_DATASETS and self.loss in CROSSENTROPY_LOSSES:
            raise ValueError(
                f"`loss={self.loss!r}` is for classification, but dataset={self.dataset!r} "
                "is a regression task; use 'auto', 'mse', 'mae' or 'huber'."
            )
        if self.loss == "binary_crossentropy" and self.dataset not in BINARY_DATASETS + ("file",):
            raise ValueError(
                f"`loss='binary_crossentropy'` needs two classes, but dataset={self.dataset!r} "
                f"has more; use it with {_listing(BINARY_DATASETS)}, or use "
                "'sparse_categorical_crossentropy'."
            )

    @property
    def residual_connections(self):
        """True when the model gets skip connections (`residual` or `residual_mlp`)."""
        return self.residual or self.architecture == "residual_mlp"

    def replace(self, **changes):
        """A copy with some fields changed, validated again.

        Example:

        >>> RunConfig().replace(depth=8).depth
        8

        Raises:
            ValueError: If a name is not a field, or the result is invalid.
        """
        _check_names(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self):
        """All fields as a plain, JSON-friendly dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values):
        """Make a config from a dict such as `to_dict()` returns.

        Args:
            values: A mapping of field names to values; missing fields take
                their defaults.

        Raises:
            ValueError: If a key is not a field, or a value is invalid.
        """
        if not isinstance(values, dict):
            raise ValueError(f"A RunConfig needs a dict of fields, got {type(values).__name__}.")
        _check_names(values)
        return cls(**values)

    def to_json(self):
        """The config as a JSON string (see `from_json`)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text):
        """Make a config from `to_json()` text.

        Raises:
            ValueError: If the text is not a JSON object of valid fields.
        """
        try:
            values = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"A RunConfig JSON must be a JSON object, got {_short(text)}: {error}."
            ) from None
        return cls.from_dict(values)

    def to_query(self):
        """The fields that differ from the defaults, as strings (for URLs).

        Returns:
            A dict of field name to string, e.g. `{"depth": "10"}`; `None`
            becomes `"none"` and booleans `"true"`/`"false"`.
        """
        query = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default:
                query[field.name] = _to_text(value)
        return query

    @classmethod
    def from_query(cls, mapping):
        """Make a config from string values such as `to_query()` or a URL gives.

        Args:
            mapping: Field name -> string (a one-element list is accepted,
                as some query-string parsers give lists).

        Raises:
            ValueError: If a key is not a field or a string does not parse.
        """
        _check_names(mapping)
        fields = {field.name: field for field in dataclasses.fields(cls)}
        values = {}
        for key, text in mapping.items():
            if isinstance(text, list | tuple) and len(text) == 1:
                text = text[0]
            values[key] = parse_field_text(fields[key], text)
        return cls(**values)


def field_table():
    """The fields of `RunConfig` with their rules, for forms and flags.

    Returns:
        A list of `(name, default, metadata)`; metadata has `kind`
        (`choice`, `int`, `float`, `bool`, `str`), `help`, and `choices` or
        `low`/`high`/`optional` where they apply.
    """
    return [(f.name, f.default, dict(f.metadata)) for f in dataclasses.fields(RunConfig)]


def check_setting(name, value):
    """Check one `RunConfig` setting alone, as the configuration checks it.

    Args:
        name: The field's name, such as `"clip_value"`.
        value: The value to check.

    Returns:
        The value as the configuration would hold it (`1` becomes `1.0`).

    Raises:
        ValueError: if the value is not allowed (the message names the field).
    """
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    return _check_field(fields[name], value)


# `field`, `field='value'`, field='value': how RunConfig's messages name a setting.
_FIELD_NOTATION = re.compile(
    r"`(?P<field>\w+)(?:='(?P<value>[^'`]*)')?`"
    r"|(?<![\w`])(?P<bare>\w+)='(?P<bare_value>[^']*)'"
)


def rename_settings(message, name_of):
    """A `RunConfig` message with each setting it names written in another way.

    The dashboard names a setting by its widget's label, the command line by
    its flag.

    Args:
        message: The message, such as "`learning_rate` must be ...".
        name_of: `(field, value) -> str or None`: how to write the field
            (with its value, or None when the message gives none); None
            keeps the message's own words. Only fields of `RunConfig` are
            rewritten.

    Returns:
        The message, rewritten.
    """
    fields = {f.name for f in dataclasses.fields(RunConfig)}

    def rewrite(match):
        field = match.group("field") or match.group("bare")
        value = match.group("value") if match.group("field") else match.group("bare_value")
        named = name_of(field, value) if field in fields else None
        return match.group(0) if named is None else named

    return _FIELD_NOTATION.sub(rewrite, message)


def parse_field_text(field, text):
    """Turn the string form of one field back into its value.

    Args:
        field: A `dataclasses.Field` of `RunConfig`.
        text: The string, as `to_query()` writes it.

    Returns:
        The value, not yet range-checked (the constructor does that).

    Raises:
        ValueError: If the string does not parse as the field's kind.
    """
    kind = field.metadata["kind"]
    if not isinstance(text, str):
        raise ValueError(f"`{field.name}` must be given as a string here, got {text!r}.")
    if kind == "str":
        # Text is kept exactly: a run may be called "none" or " padded ".
        # (to_query leaves out a text field that is None, its default.)
        return text
    stripped = text.strip()
    if field.metadata.get("optional") and stripped.lower() in ("", "none", "null"):
        return None
    if kind == "bool":
        lowered = stripped.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"`{field.name}` must be true or false, got {text!r}.")
    if kind == "int":
        try:
            return int(stripped)
        except ValueError:
            raise ValueError(
                f"`{field.name}` must be an integer from {field.metadata['low']} to "
                f"{field.metadata['high']}, got {text!r}."
            ) from None
    if kind == "float":
        try:
            return float(stripped)
        except ValueError:
            raise ValueError(f"`{field.name}` must be a number, got {text!r}.") from None
    return stripped


def _check_field(field, value):
    meta = field.metadata
    kind = meta["kind"]
    if value is None and meta.get("optional"):
        return None
    if kind == "choice":
        if not isinstance(value, str) or value not in meta["choices"]:
            raise ValueError(
                f"`{field.name}` must be one of {_listing(meta['choices'])}, got {value!r}."
            )
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"`{field.name}` must be True or False, got {value!r}.")
        return value
    if kind == "str":
        if not isinstance(value, str) or len(value) > meta["max_length"]:
            raise ValueError(
                f"`{field.name}` must be None or a string of at most {meta['max_length']} "
                f"characters, got {_short(value)}."
            )
        if not value.strip():
            # A blank run name showed as nothing in lists, subtitles and file names.
            raise ValueError(
                f"`{field.name}` must be None or hold a visible character, got {value!r}."
            )
        return value
    low, high = meta["low"], meta["high"]
    none_hint = "None or " if meta.get("optional") else ""
    if kind == "int":
        # bool is an int in Python, but `depth=True` is a mistake, not 1.
        if (
            not isinstance(value, numbers.Integral)
            or isinstance(value, bool)
            or not (low <= value <= high)
        ):
            raise ValueError(
                f"`{field.name}` must be {none_hint}an integer {_span(meta)}, "
                f"got {_described(value)}."
            )
        return int(value)
    # kind == "float"
    low_open = meta["low_open"]
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not (low < value <= high if low_open else low <= value <= high)
    ):
        raise ValueError(
            f"`{field.name}` must be {none_hint}a number {_span(meta)}, got {_described(value)}."
        )
    return float(value)


def _span(meta):
    """The range a number setting takes, as its messages say it.

    "from 1 to 100" for an integer; "greater than 0 and at most 1e+06", or
    "at least 0 and at most 0.9", for a number.
    """
    low, high = meta["low"], meta["high"]
    if meta["kind"] == "int":
        return f"from {low} to {high}"
    lower = f"greater than {low:g}" if meta["low_open"] else f"at least {low:g}"
    return f"{lower} and at most {high:g}"


def allowed_range(name):
    """The range the number setting `name` takes, in its messages' words (`_span`)."""
    return _span(next(f.metadata for f in dataclasses.fields(RunConfig) if f.name == name))


def _check_names(mapping):
    known = [field.name for field in dataclasses.fields(RunConfig)]
    unknown = [key for key in mapping if key not in known]
    if unknown:
        raise ValueError(
            f"Unknown RunConfig field(s) {_listing(unknown)}; the fields are {_listing(known)}."
        )


def _to_text(value):
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _listing(names):
    return ", ".join(repr(name) for name in names)


def _described(value):
    # "got '3' (a str)" tells a form or JSON user why a number-looking value failed.
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return repr(value)
    return f"{_short(value)} (a {type(value).__name__})"


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_name(config):
    """A short name a student recognises in a list of runs.

    The settings a lesson varies, where they differ from the defaults: two
    runs that differ only in their initializer once had the same name, and
    so did a SimpleRNN and an LSTM, and a network and the same one with
    residual connections (the name starts exported files' names).
    """
    if config.name:
        return config.name
    default = RunConfig()
    parts = []
    if config.architecture == "rnn":
        parts.append(_RNN_WORDS[config.rnn_cell])
    elif config.architecture != default.architecture:
        parts.append(_ARCHITECTURE_WORDS[config.architecture])
    parts += [config.activation, f"depth {config.depth}"]
    if config.initializer != default.initializer:
        parts.append(
            f"{config.initializer} σ={config.init_stddev:g}"
            if config.initializer == "random_normal"
            else config.initializer
        )
    if config.width != default.width:
        parts.append(f"width {config.width}")
    if config.residual and config.architecture != "residual_mlp":
        parts.append("residual")
    for field, words in (("normalization", "{} norm"), ("clipping", "clip {}")):
        value = getattr(config, field)
        if value != getattr(default, field):
            parts.append(words.format(value))
    if config.dropout:
        parts.append(f"dropout {config.dropout:g}")
    if config.max_norm is not None:
        parts.append(f"max-norm {config.max_norm:g}")
    parts.append(f"{config.optimizer} lr={config.learning_rate:g}")
    if config.batch_size != default.batch_size:
        parts.append(f"batch {config.batch_size}")
    if config.dataset != default.dataset:
        parts.append(f"on {config.dataset}")
    return " · ".join(parts)


_RNN_WORDS = {"simple_rnn": "SimpleRNN", "lstm": "LSTM", "gru": "GRU"}
_ARCHITECTURE_WORDS = {"cnn": "CNN", "residual_mlp": "residual MLP"}
