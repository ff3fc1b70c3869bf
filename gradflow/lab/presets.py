"""One-click lecture presets: a named `RunConfig` and what it shows.

Each preset was checked on CPU by training it with plain `model.fit` and
measuring per-layer kernel-gradient L2 norms with a `tf.GradientTape` on 256
fixed training examples, before the first step and after the last (numbers in
each preset's notes; seed 0, digits unless said), and again end to end with
`gradflow train --preset KEY` (the recorded per-layer norms agreed). They run
in seconds to a minute on a busy two-core CPU.

Example:

```python
from gradflow.lab.presets import PRESETS, get_preset

for preset in PRESETS.values():
    print(preset.key, "-", preset.title)
run = gradflow.train(get_preset("deep_sigmoid").config)
```
"""

import dataclasses

from gradflow.lab.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named configuration for a lecture demo.

    Attributes:
        key: Short identifier, e.g. `"deep_sigmoid"`.
        title: Button label.
        description: What to look at, in one or two sentences for students.
        config: The `RunConfig` to train (its `name` is the title).
        compare_with: Key of the preset it is meant to be run beside, or None.
    """

    key: str
    title: str
    description: str
    config: RunConfig
    compare_with: str | None = None


def _preset(key, title, description, compare_with=None, **fields):
    config = RunConfig(name=title, **fields)
    return Preset(key, title, description, config, compare_with)


_DEEP_SIGMOID = dict(depth=10, activation="sigmoid", learning_rate=0.1)
_LARGE_INIT = dict(
    depth=8, activation="relu", initializer="random_normal", init_stddev=0.5, learning_rate=0.1
)
_ADDING = dict(
    architecture="rnn",
    dataset="adding",
    sequence_length=30,
    n_samples=2000,
    depth=1,
    width=32,
    activation="tanh",
    optimizer="adam",
    learning_rate=0.01,
    steps=800,
)

PRESETS = {
    preset.key: preset
    for preset in (
        # Seen: kernel-gradient norm 2.8e-7 in dense_1 against 0.36 in
        # output (six orders of magnitude, falling ~4x per layer); the loss
        # stays at ln(10) = 2.31, accuracy at chance (0.09) after 300 steps.
        _preset(
            "deep_sigmoid",
            "Deep sigmoid network: vanishing gradients",
            "Ten sigmoid layers: the gradient shrinks about 4x per layer on its way back, so "
            "the first layers get almost nothing (about 1e-7, against about 1 at the output) "
            "and the network does not learn.",
            compare_with="relu_he",
            **_DEEP_SIGMOID,
        ),
        # Seen: norms 0.5-1.0 in every layer at step 0, 0.7-3 at step 300;
        # loss 2.5 -> 1.3, accuracy 0.57.
        _preset(
            "relu_he",
            "ReLU with He initialization: gradients reach every layer",
            "The same ten layers with ReLU and He-normal initialization: every layer gets a "
            "gradient of similar size and the loss falls.",
            compare_with="deep_sigmoid",
            depth=10,
            activation="relu",
            initializer="he_normal",
            learning_rate=0.05,
        ),
        # Seen: loss 325 and kernel-gradient norms 220-330 in every layer at
        # the first step (a healthy net: ~0.5); the loss is NaN within 300
        # steps.
        _preset(
            "large_init",
            "Large initial weights: exploding gradients",
            "Weights drawn with standard deviation 0.5 (He for these 32-unit layers: 0.25) "
            "double the signal at each of eight ReLU layers. On its way back the gradient "
            "doubles at each layer too (under Gradients of, choose Activations), the weights' gradients "
            "start in the hundreds, and SGD diverges to NaN.",
            compare_with="large_init_clipped",
            activations=True,
            **_LARGE_INIT,
        ),
        # Seen: the same first step (gradient norms ~300), but the update is
        # scaled to global norm 1; loss on the probe batch 325 -> 1.6,
        # training accuracy 0.40 after 300 steps, no NaN.
        _preset(
            "large_init_clipped",
            "Exploding gradients tamed by clipping",
            "The same exploding network with the global gradient norm clipped to 1: the raw "
            "gradients are still huge, but each update is bounded, so training no longer "
            "blows up to NaN. It learns slowly: the oversized weights are still there (compare "
            "its loss with ReLU and He initialization).",
            compare_with="large_init",
            clipping="global_norm",
            clip_value=1.0,
            **_LARGE_INIT,
        ),
        # Seen (no bias before each BatchNorm): dense_1 gradient norm 0.49
        # at step 1 (1e-7 without BatchNorm), all layers 0.33-0.49; loss
        # 2.5 -> 0.42, accuracy 0.94.
        _preset(
            "batch_norm",
            "Batch normalization rescues the deep sigmoid network",
            "The deep sigmoid network with BatchNorm before each sigmoid: the inputs stay in "
            "the sigmoid's steep range, gradients are even across layers, and it learns.",
            compare_with="deep_sigmoid",
            normalization="batch",
            **_DEEP_SIGMOID,
        ),
        # Seen: dense_1 gradient norm 0.9 (1e-7 without skips), growing
        # smoothly to 2.5 at dense_10; loss 7.6 -> 0.18, accuracy 0.82.
        _preset(
            "residual",
            "Residual connections give gradients a shortcut",
            "The deep sigmoid network with a skip connection around every layer: the gradient "
            "flows back through the additions, and the first layers learn.",
            compare_with="deep_sigmoid",
            residual=True,
            **_DEEP_SIGMOID,
        ),
        # Seen: step 0 norms 0.2-0.4 with 14-28% zeros; after 300 steps every
        # kernel gradient is exactly 0 (zero_fraction 1.0), loss stuck at 2.31.
        _preset(
            "dead_relu",
            "Dead ReLUs at a high learning rate",
            "SGD with learning rate 1.0 knocks the ReLU units into the region where they "
            "output 0 for every input: their gradients become exactly zero and never recover.",
            depth=6,
            activation="relu",
            initializer="he_normal",
            learning_rate=1.0,
        ),
        # Seen (30 steps, 800 Adam steps): loss stays at the 0.17 baseline
        # of predicting the mean; the cell kernel's gradient norm falls
        # from 1.6 to 0.03 and stays there. With `gradflow train`: mean loss
        # of the last 50 steps 0.165.
        # Through time (`gradflow train --preset rnn_simple`, 800 steps): the
        # gradient at steps 1-3 over steps 28-30 has a median of 1.2e-2 over
        # steps 401-800, between about 1e-3 and 1e-1 from step to step (1.4e-3
        # over steps 701-800, 4e-2 over the last 25); the LSTM's passes 0.3 at
        # step 312, median 1.26 over steps 401-800. Alerts (`--seed 0` to 3):
        # both vanish through time from steps 13-39; the LSTM's comes back
        # (said at steps 350-511) and stays, the SimpleRNN's for a while in
        # seeds 1 (346, low again at 555) and 3 (648, low again at 668).
        _preset(
            "rnn_simple",
            "SimpleRNN on a long sequence: it cannot remember",
            "The adding problem over 30 steps: the SimpleRNN's gradient through time vanishes, "
            "so it never links the first marked number to the answer. Watch the Loss view: it "
            "stays at 0.17, what predicting the average gives. Then Heatmaps, Through time: "
            "one row per time step, and the first steps, at the bottom, stay dark: about a "
            "hundredth of the last, at times a thousandth. The Alerts view says so too.",
            compare_with="rnn_lstm",
            rnn_cell="simple_rnn",
            **_ADDING,
        ),
        # Seen: the same task; loss 1.3 -> 0.0006 on the probe batch after
        # 800 steps (epoch mean 0.08): the LSTM solves it. With `gradflow
        # train`: mean loss of the last 50 steps 0.0006.
        _preset(
            "rnn_lstm",
            "LSTM on the same long sequence: it remembers",
            "The LSTM's cell state carries the gradient across the 30 steps: its loss drops "
            "far below the 0.17 baseline of predicting the average. In Heatmaps, Through "
            "time, the first steps, at the bottom, light up at about step 300: it has learnt "
            "to carry them to the output. The Alerts view says when.",
            compare_with="rnn_simple",
            rnn_cell="lstm",
            **_ADDING,
        ),
    )
}


def get_preset(key):
    """The preset called `key`.

    Example:

    >>> get_preset("dead_relu").config.learning_rate
    1.0

    Raises:
        ValueError: If there is no such preset; the message lists them.
    """
    if key not in PRESETS:
        raise ValueError(f"Unknown preset {key!r}; the presets are {', '.join(PRESETS)}.")
    return PRESETS[key]
