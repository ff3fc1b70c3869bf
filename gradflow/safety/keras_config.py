"""Allow-list check of a `.keras` file's `config.json`, at every depth.

Keras turns every dict with a `class_name` into an object: it may import the
dict's `module`, look up its `registered_name`, unmarshal `__lambda__`
bytecode, or build a layer that reads files. Instead of listing what is
dangerous, this module lists what is allowed: core `keras.layers` classes,
built-in activations, initializers, regularizers and constraints, plus the
plain data Keras uses to wire a functional graph. Anything else is refused
with the path where it was found (e.g. `config.layers[3].config.function`).

Pure Python on already-parsed JSON: no Keras import, nothing executed.
"""

import math
import re

from gradflow.safety.errors import UnsafeInputError

# fmt: off
_LAYERS = {
    # Core and shape layers.
    "InputLayer", "Dense", "Activation", "Dropout", "SpatialDropout1D", "SpatialDropout2D",
    "SpatialDropout3D", "GaussianNoise", "GaussianDropout", "AlphaDropout", "Flatten",
    "Reshape", "Permute", "RepeatVector", "Identity", "Masking", "Embedding",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D",
    "Cropping3D", "UpSampling1D", "UpSampling2D", "UpSampling3D",
    # Convolution and pooling.
    "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
    "SeparableConv1D", "SeparableConv2D", "DepthwiseConv1D", "DepthwiseConv2D",
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
    "AveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
    # Normalization.
    "BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization",
    # Merging.
    "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate", "Dot",
    # Activation layers.
    "ReLU", "LeakyReLU", "PReLU", "ELU", "Softmax",
    # Recurrent.
    "SimpleRNN", "SimpleRNNCell", "LSTM", "LSTMCell", "GRU", "GRUCell", "RNN",
    "StackedRNNCells", "Bidirectional", "TimeDistributed", "ConvLSTM1D", "ConvLSTM2D",
    "ConvLSTM3D",
    # Attention and einsum projections.
    "MultiHeadAttention", "GroupQueryAttention", "Attention", "AdditiveAttention",
    "EinsumDense",
    # Preprocessing that reads no file: scaling, and image resizing and augmentation.
    "Rescaling", "Normalization", "Resizing", "CenterCrop", "RandomFlip", "RandomRotation",
    "RandomZoom", "RandomTranslation", "RandomContrast", "RandomCrop", "RandomBrightness",
    "ActivityRegularization",
}
# Keras ops a Functional model records as layers (`x + shortcut`, `x * 2.0`,
# `keras.ops.mean(x)`), by the module Keras writes for them. Pure tensor math
# on their inputs: no functions, no files, and none that makes an array of a
# size its config sets (`Full`, `Arange`, `Tile`, ...), which a forward pass
# would allocate.
_OPS = {
    "keras.src.ops.numpy": {
        "Abs", "Absolute", "Add", "All", "Amax", "Amin", "Any", "Arctan", "Arctan2", "Argmax",
        "Argmin", "Average", "Ceil", "Clip", "Concatenate", "Cos", "Cosh", "Cumsum", "Divide",
        "DivideNoNan", "Dot", "Einsum", "Equal", "Exp", "Expm1", "ExpandDims", "Flip", "Floor",
        "FloorDivide", "GetItem", "Greater", "GreaterEqual", "Hypot", "Isfinite", "Isinf",
        "Isnan", "Less", "LessEqual", "Log", "Log10", "Log1p", "Log2", "Logaddexp",
        "LogicalAnd", "LogicalNot", "LogicalOr", "Matmul", "Max", "Maximum", "Mean", "Min",
        "Minimum", "Mod", "Moveaxis", "Multiply", "NanToNum", "Negative", "NotEqual", "OnesLike",
        "Pad", "Power", "Prod", "Reciprocal", "Reshape", "Round", "Sign", "Sin", "Sinh", "Sort",
        "Split", "Sqrt", "Square", "Squeeze", "Stack", "Std", "Subtract", "Sum", "Swapaxes",
        "Take", "TakeAlongAxis", "Tan", "Tanh", "Tensordot", "Transpose", "Tril", "Triu",
        "TrueDivide", "Var", "Where", "ZerosLike",
    },
    "keras.src.ops.nn": {
        "AveragePool", "Celu", "Elu", "Gelu", "Glu", "HardSigmoid", "HardSilu", "HardTanh",
        "LeakyRelu", "LogSigmoid", "LogSoftmax", "MaxPool", "Moments", "Normalize", "Relu",
        "Relu6", "Selu", "Sigmoid", "Silu", "Softmax", "Softplus", "Softsign",
    },
    "keras.src.ops.math": {"Erf", "Logsumexp", "Rsqrt", "TopK"},
    "keras.src.ops.core": {"Cast", "StopGradient"},
}
_INITIALIZERS = {
    "Constant", "GlorotNormal", "GlorotUniform", "HeNormal", "HeUniform", "Identity",
    "LecunNormal", "LecunUniform", "Ones", "Orthogonal", "RandomNormal", "RandomUniform",
    "TruncatedNormal", "VarianceScaling", "Zeros",
}
_REGULARIZERS = {"L1", "L2", "L1L2", "OrthogonalRegularizer"}
_CONSTRAINTS = {"MaxNorm", "MinMaxNorm", "NonNeg", "UnitNorm"}

# class_name -> modules Keras writes for it. Anything else is refused.
_ALLOWED = {name: {"keras.layers"} for name in _LAYERS}
_ALLOWED.update({name: {"keras.initializers"} for name in _INITIALIZERS})
_ALLOWED["Identity"] = {"keras.layers", "keras.initializers"}
_ALLOWED.update({name: {"keras.regularizers"} for name in _REGULARIZERS})
_ALLOWED.update({name: {"keras.constraints"} for name in _CONSTRAINTS})
_ALLOWED.update(
    {
        "Sequential": {"keras", "keras.models", "keras.src.models.sequential"},
        "Functional": {"keras", "keras.models", "keras.src.models.functional"},
        "Model": {"keras", "keras.models", "keras.src.models.model"},
        "DTypePolicy": {"keras", "keras.dtype_policies"},
        "FloatDTypePolicy": {"keras", "keras.dtype_policies"},
    }
)
for module, names in _OPS.items():
    for name in names:
        _ALLOWED.setdefault(name, set()).add(module)
_MODEL_MODULES = set().union(*_ALLOWED.values())
# The top-level compile_config is never deserialized (`compile=False`), but it
# is still walked: if it names anything but Keras optimizers, schedules, losses
# and metrics, it is dropped from the parsed config
# (`_Walker.visit_compile_config`). A nested model's compile_config is always
# dropped (`_Walker.drop_nested_compile_config`): Keras compiles nested models
# even with `compile=False`, so the loader writes the checked config into its
# private copy for Keras to read.
_COMPILE_MODULES = {
    "keras.optimizers",
    "keras.optimizers.schedules",
    "keras.losses",
    "keras.metrics",
}

_ACTIVATIONS = {
    "celu", "elu", "exponential", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish",
    "hard_shrink", "hard_tanh", "leaky_relu", "linear", "log_sigmoid", "log_softmax", "mish",
    "relu", "relu6", "selu", "sigmoid", "silu", "softmax", "softplus", "softsign",
    "soft_shrink", "sparse_plus", "sparsemax", "squareplus", "swish", "tanh", "tanh_shrink",
    "threshold",
}
_INITIALIZER_NAMES = {
    "constant", "glorot_normal", "glorot_uniform", "he_normal", "he_uniform", "identity",
    "lecun_normal", "lecun_uniform", "ones", "orthogonal", "random_normal", "random_uniform",
    "truncated_normal", "variance_scaling", "zeros",
}
_REGULARIZER_NAMES = {"l1", "l2", "l1_l2", "orthogonal_regularizer"}
_CONSTRAINT_NAMES = {"max_norm", "min_max_norm", "non_neg", "unit_norm"}
# fmt: on

# Names that deserve their own explanation (the CVE behind them, what to do).
_KNOWN_DANGEROUS = {
    "Lambda": "a Lambda layer carries Python bytecode that runs on load (CVE-2024-3660); "
    "rewrite it with built-in layers",
    "TFSMLayer": "a TFSMLayer loads a TensorFlow SavedModel from a path on the server",
    "TorchModuleWrapper": "a TorchModuleWrapper unpickles a PyTorch module, which runs code",
    "JaxLayer": "a JaxLayer wraps arbitrary Python functions",
    "FlaxLayer": "a FlaxLayer wraps arbitrary Python modules",
    "StringLookup": "a StringLookup vocabulary may name a file on the server, which Keras "
    "reads (CVE-2025-12058)",
    "IntegerLookup": "an IntegerLookup vocabulary may name a file on the server, which Keras "
    "reads (CVE-2025-12058)",
    "TextVectorization": "a TextVectorization vocabulary may name a file on the server",
    "Hashing": "preprocessing layers are not accepted in uploaded models",
}
_SPECIAL_MARKERS = {
    "__lambda__": "serialized Python bytecode (`__lambda__`), which runs on load",
    "function": "a reference to a Python function by module and name",
    "__typespec__": "a TensorFlow type spec, which imports a class by name",
    "__numpy__": "an embedded array",
    "__tensor__": "an embedded tensor",
    "__bytes__": "embedded bytes",
}
# Keras resolves these strings only among its own built-ins; both the
# snake_case alias and the class name ("he_normal", "HeNormal") are accepted.
_KEY_SUFFIX_NAMES = {
    "activation": _ACTIVATIONS,
    "initializer": _INITIALIZER_NAMES | _INITIALIZERS,
    "regularizer": _REGULARIZER_NAMES | _REGULARIZERS,
    "constraint": _CONSTRAINT_NAMES | _CONSTRAINTS,
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
_MAX_DEPTH = 64
_FIX = (
    "gradflow accepts models built only from core Keras layers with built-in "
    "activations; rebuild the model without it and save it again with model.save('m.keras')."
)


def check_model_config(config, *, max_weight_entries):
    """Checks a parsed `config.json` against the allow-list and the weight cap.

    Example:

    ```python
    config = json.loads(zipfile.ZipFile("m.keras").read("config.json"))
    n = check_model_config(config, max_weight_entries=20_000_000)
    ```

    Args:
        config: the parsed JSON of `config.json`.
        max_weight_entries: most weight values (product of declared weight
            shapes, summed over layers) the model may declare.

    Returns:
        The estimated number of weight values the config declares.

    Raises:
        UnsafeInputError: naming the first disallowed object and where it is.
    """
    if not isinstance(config, dict) or "class_name" not in config:
        raise UnsafeInputError(
            "config.json of the model file is not a Keras model config (expected a JSON "
            f"object with 'class_name'). {_FIX}"
        )
    walker = _Walker(max_weight_entries)
    walker.visit(config, "", depth=0, in_compile=False)
    return walker.weight_entries


class _Walker:
    def __init__(self, max_weight_entries):
        self.max_weight_entries = max_weight_entries
        self.weight_entries = 0
        self.dropped_compile_config = None
        self.dropped_nested_compile_configs = []

    def visit(self, node, path, depth, in_compile):
        if depth > _MAX_DEPTH:
            raise UnsafeInputError(
                f"The model config is nested deeper than {_MAX_DEPTH} at {_where(path)}."
            )
        if isinstance(node, dict):
            if "class_name" in node:
                self.check_object(node, path, in_compile)
            elif "module" in node or "registered_name" in node:
                self.check_module(node.get("module"), "?", path, in_compile)
                self.check_registered_name(node, "?", path)
            for key, value in node.items():
                if not isinstance(key, str):
                    raise UnsafeInputError(
                        f"The model config has a non-string key at {_where(path)}."
                    )
                child_path = f"{path}.{key}" if path else key
                self.check_named_value(key, value, child_path, in_compile)
                if key == "compile_config" and not in_compile:
                    if path:
                        self.drop_nested_compile_config(node, value, child_path)
                    else:
                        self.visit_compile_config(node, value, child_path, depth + 1)
                    continue
                self.visit(value, child_path, depth + 1, in_compile)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                self.visit(value, f"{path}[{i}]", depth + 1, in_compile)
        elif isinstance(node, float) and math.isnan(node):
            return
        elif not (node is None or isinstance(node, (str, int, float, bool))):
            raise UnsafeInputError(
                f"Unexpected value of type {type(node).__name__} at {_where(path)}."
            )

    def visit_compile_config(self, parent, value, path, depth):
        """The top-level training settings: never deserialized (`compile=False`), so not refused.

        A model compiled with the user's own loss or metric is otherwise fine;
        refused, its owner was told to rebuild a model that has nothing
        wrong. Settings that are not all built-in are dropped from the parsed
        config, so that nothing downstream (`models.saved_loss`) reads them.
        A nested model's settings are dropped whatever they name
        (`drop_nested_compile_config`): Keras deserializes those.
        """
        try:
            self.visit(value, path, depth, in_compile=True)
        except UnsafeInputError as error:
            parent["compile_config"] = None
            self.dropped_compile_config = str(error)

    def drop_nested_compile_config(self, parent, value, path):
        """Drops the training settings of a model inside the model.

        `load_model(compile=False)` clears only the top-level compile_config;
        Keras's deserializer compiles every nested object that has one, so its
        losses and metrics are built on load (a `MeanIoU(num_classes=10000)`
        allocated 800 MB). A compiled pretrained backbone inside a new model
        is the usual transfer-learning recipe, and the outer model's loss is
        the one that counts, so it is dropped, not refused: the loader then
        writes the checked config into its private copy
        (`gradflow.safety.models`), and Keras reads that.
        """
        if value:
            # Keras compiles only on a non-empty one (`if compile_config:`), and
            # saves a nested model that was never compiled with `{}`.
            parent["compile_config"] = None
            self.dropped_nested_compile_configs.append(path)

    def check_object(self, node, path, in_compile):
        class_name = node["class_name"]
        if not isinstance(class_name, str):
            raise UnsafeInputError(f"class_name at {_where(path)} is {class_name!r}, not a string.")
        if class_name == "__keras_tensor__":
            # Functional wiring: a shape, a dtype and a (layer, node, tensor) reference.
            return
        if in_compile and _is_keras_compile_function(node):
            return
        if class_name in _SPECIAL_MARKERS:
            raise UnsafeInputError(
                f"Refused model file: {_SPECIAL_MARKERS[class_name]} at {_where(path)} "
                f"(module {node.get('module')!r}, config {_short(node.get('config'))}). {_FIX}"
            )
        if class_name in _KNOWN_DANGEROUS:
            raise UnsafeInputError(
                f"Refused model file: layer {class_name!r} at {_where(path)}: "
                f"{_KNOWN_DANGEROUS[class_name]}. {_FIX}"
            )
        module = node.get("module")
        self.check_module(module, class_name, path, in_compile)
        self.check_registered_name(node, class_name, path)
        if in_compile:
            if not _IDENTIFIER.fullmatch(class_name):
                raise UnsafeInputError(
                    f"Refused model file: class_name {class_name!r} at {_where(path)}."
                )
            return
        allowed_modules = _ALLOWED.get(class_name)
        if allowed_modules is None or module not in allowed_modules:
            raise UnsafeInputError(
                f"Refused model file: {class_name!r} (module {module!r}) at {_where(path)} is not on "
                f"gradflow's allow-list of core Keras classes. {_FIX}"
            )
        if class_name in _LAYERS:
            self.count_weights(node, path)

    def check_module(self, module, class_name, path, in_compile):
        if module is None:
            return
        allowed = _COMPILE_MODULES if in_compile else _MODEL_MODULES
        if not isinstance(module, str) or module not in allowed:
            raise UnsafeInputError(
                f"Refused model file: {class_name!r} at {_where(path)} names the Python module "
                f"{module!r}. Keras would import it and look the name up there "
                "(the CVE-2025-1550 gadget); only the core keras modules are accepted. "
                f"{_FIX}"
            )

    def check_registered_name(self, node, class_name, path):
        registered = node.get("registered_name")
        if registered is None or registered == class_name:
            return
        raise UnsafeInputError(
            f"Refused model file: {class_name!r} at {_where(path)} is registered as "
            f"{registered!r}, a custom object. Custom objects are not accepted in uploads; "
            f"{_FIX}"
        )

    def check_named_value(self, key, value, path, in_compile):
        if in_compile or not isinstance(value, str):
            return
        for suffix, names in _KEY_SUFFIX_NAMES.items():
            if key == suffix or key.endswith("_" + suffix):
                if value not in names:
                    raise UnsafeInputError(
                        f"Refused model file: {key}={value!r} at {_where(path)} is not a built-in "
                        f"Keras {suffix}. Allowed: {', '.join(sorted(names))}."
                    )

    def count_weights(self, node, path):
        config = node.get("config")
        if not isinstance(config, dict):
            return
        n = _declared_weights(node["class_name"], config, _input_dims(node))
        if n is None:
            raise UnsafeInputError(
                f"Refused model file: layer at {_where(path)} declares sizes that are not "
                "positive integers."
            )
        self.weight_entries += n
        if self.weight_entries > self.max_weight_entries:
            raise UnsafeInputError(
                f"Refused model file: the layers up to {_where(path)} ({node['class_name']} "
                f"{config.get('name')!r}) declare about {self.weight_entries:,} weight values, "
                f"over the limit of `max_weight_entries`={self.max_weight_entries:,}. "
                "Upload a smaller model or raise `max_weight_entries`."
            )


def _input_dims(node):
    """The largest known size of the last and channel axes of a layer's input."""
    shapes = []
    build = node.get("build_config")
    if isinstance(build, dict):
        shapes.append(build.get("input_shape"))
    # Functional graphs record the shape of each call's inputs too.
    for inbound in node.get("inbound_nodes") or []:
        if isinstance(inbound, dict):
            for arg in inbound.get("args") or []:
                if isinstance(arg, dict) and arg.get("class_name") == "__keras_tensor__":
                    shapes.append((arg.get("config") or {}).get("shape"))
    last, second = 1, 1
    for shape in shapes:
        if isinstance(shape, list) and shape and all(_dim(d) is not None for d in shape):
            last = max(last, _dim(shape[-1]) or 1)
            if len(shape) > 1:
                second = max(second, _dim(shape[1]) or 1)
    return last, second


def _dim(d):
    if d is None:
        return 0
    if isinstance(d, int) and not isinstance(d, bool) and d >= 0:
        return d
    return None


def _size(config, key, default=1):
    value = config.get(key, default)
    if value is None:
        return default
    if isinstance(value, list):
        sizes = [_size({"v": v}, "v") for v in value]
        return None if None in sizes else math.prod(sizes)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _declared_weights(class_name, config, input_dims):
    """Weight values a layer allocates when built, from its config and input size.

    An estimate for the clear early message; the child process counts the real
    parameters after building, under a memory limit.
    """
    last, second = input_dims
    channels = second if config.get("data_format") == "channels_first" else last
    units = _size(config, "units", 0)
    if units is None:
        return None
    if class_name == "Dense":
        return units * (last + 1)
    if class_name == "Embedding":
        a, b = _size(config, "input_dim"), _size(config, "output_dim")
        return None if None in (a, b) else a * b
    if class_name in ("SimpleRNN", "SimpleRNNCell", "LSTM", "LSTMCell", "GRU", "GRUCell"):
        gates = {"L": 4, "G": 3}.get(class_name[0], 1)
        return gates * units * (last + units + 2)
    if class_name.startswith("ConvLSTM"):
        kernel, filters = _size(config, "kernel_size"), _size(config, "filters", 0)
        if None in (kernel, filters):
            return None
        return 4 * kernel * (channels + filters) * filters + 4 * filters
    if class_name == "MultiHeadAttention":
        heads, key = _size(config, "num_heads", 0), _size(config, "key_dim", 0)
        value = _size(config, "value_dim", 0) if config.get("value_dim") is not None else key
        if None in (heads, key, value):
            return None
        projections = heads * (2 * key + value)
        return last * projections + projections + heads * value * last + last
    if class_name == "GroupQueryAttention":
        sizes = [
            _size(config, k, 0) for k in ("num_query_heads", "num_key_value_heads", "head_dim")
        ]
        if None in sizes:
            return None
        query_heads, key_value_heads, head = sizes
        projections = head * (query_heads + 2 * key_value_heads)
        return last * projections + projections + query_heads * head * last + last
    if class_name == "EinsumDense":
        shape = config.get("output_shape")
        shape = shape if isinstance(shape, list) else [shape]
        # Unknown (batch or sequence) axes of the output carry no weights.
        sizes = [1 if d is None else _size({"d": d}, "d") for d in shape]
        if None in sizes:
            return None
        return math.prod(sizes) * (last + 1)
    if "Conv" in class_name:
        kernel = _size(config, "kernel_size")
        filters = _size(config, "filters", 0)
        depth = _size(config, "depth_multiplier")
        if None in (kernel, filters, depth):
            return None
        if class_name.startswith("Depthwise"):
            return kernel * channels * depth + channels * depth
        if class_name.startswith("Separable"):
            return kernel * channels * depth + channels * depth * filters + filters
        return kernel * channels * filters + filters
    if class_name in ("BatchNormalization", "LayerNormalization", "GroupNormalization"):
        return 4 * channels
    if class_name == "PReLU":
        return last
    return 0


def _is_keras_compile_function(node):
    """A built-in loss or metric function, e.g. `keras.losses.mean_squared_error`.

    Keras writes these with module "builtins" and resolves them only inside its
    own losses/metrics/... modules; compile_config is dropped anyway.
    """
    name = node.get("config")
    return (
        node["class_name"] == "function"
        and node.get("module") in ("builtins", "keras.losses", "keras.metrics")
        and isinstance(name, str)
        and _IDENTIFIER.fullmatch(name) is not None
        and node.get("registered_name") in (None, name, "function")
    )


def _where(path):
    return f"{path} in config.json" if path else "the top of config.json"


def _short(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
