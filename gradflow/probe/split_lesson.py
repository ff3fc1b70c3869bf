"""The split-backprop lesson: one tape per part, chained, against one joint tape.

Behind the dashboard's Split backprop page: what each part of the three-part
CNN receives from above (`output_gradients`), proof that chaining equals one
joint tape, and why nobody multiplies full Jacobians: their time and memory
grow with the square of the activation size.
"""

import dataclasses
import time

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from gradflow.probe.chain import (
    DEFAULT_MAX_JACOBIAN_ENTRIES,
    ChainedBackprop,
    split_cnn,
    toy_batch,
)


@dataclasses.dataclass
class SplitLesson:
    """Tables for the split-backprop page.

    Attributes:
        parts: One row per part: `part`, `layers`, `output_shape`, the
            `upstream_l2_norm` and `upstream_max_abs` of dLoss/d(part output)
            it was handed, and `weight_grad_l2_norm`.
        agreement: One row per variable: `part`, `variable`, and the largest
            absolute difference from one joint tape for `vjp` and `jacobian`.
        cost: One row per input size and method: `input_size`,
            `jacobian_entries` (of the largest Jacobian), `method`,
            `milliseconds` (median), `jacobian_megabytes`, and `formed`: False
            (and `milliseconds` NaN) where the largest Jacobian is over
            `ChainedBackprop`'s `max_jacobian_entries`, so the Jacobian way
            was not run.
        loss: The batch loss.
    """

    parts: pd.DataFrame
    agreement: pd.DataFrame
    cost: pd.DataFrame
    loss: float


def _joint_gradients(parts, x, y, loss_fn):
    variables = [v for part in parts for v in part.trainable_variables]
    with tf.GradientTape() as tape:
        h = x
        for part in parts:
            h = part(h, training=False)
        loss = loss_fn(y, h)
    return tape.gradient(loss, variables)


def _median_ms(function, repeats):
    function()  # trace and warm up outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def split_backprop_lesson(
    sizes=(6, 8, 10, 12),
    batch_size=8,
    repeats=3,
    seed=0,
    max_jacobian_entries=DEFAULT_MAX_JACOBIAN_ENTRIES,
):
    """Run the split-backprop lesson on the three-part CNN of `split_cnn`.

    Example:

    ```python
    lesson = split_backprop_lesson(sizes=(6, 8))
    lesson.agreement["vjp"].max()     # ~1e-7: chaining equals one joint tape
    ```

    Args:
        sizes: Square input sizes (pixels per side) for the cost table; the
            first one is used for the parts and agreement tables. Defaults to
            `(6, 8, 10, 12)`.
        batch_size: Batch size. Defaults to 8.
        repeats: Timed repetitions per measurement (median). Defaults to 3.
        seed: Seed of the weights and the batch. Defaults to 0.
        max_jacobian_entries: Sizes whose largest Jacobian is bigger skip
            the Jacobian way (`formed` False in `cost`). Defaults to
            `ChainedBackprop`'s 20,000,000 (80 MB of float32).

    Returns:
        A `SplitLesson`.

    Raises:
        ValueError: for sizes under 5 (two 3x3 convolutions need room) or an
            empty `sizes`.
    """
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 5:
        raise ValueError(f"`sizes` must be a non-empty list of input sizes >= 5, got {sizes}.")
    loss_fn = keras.losses.MeanSquaredError(dtype="float32")  # whatever `floatx()` is
    parts_rows, agreement_rows, cost_rows, loss = [], [], [], float("nan")
    for index, size in enumerate(sizes):
        shape = (size, size, 1)
        parts = split_cnn(input_shape=shape, seed=seed)
        x, y = toy_batch(batch_size, input_shape=shape, seed=seed)
        vjp = ChainedBackprop(parts, loss=loss_fn, method="vjp")
        jacobian = ChainedBackprop(
            parts, loss=loss_fn, method="jacobian", max_jacobian_entries=max_jacobian_entries
        )
        largest, h = 0, x
        for part in parts:
            out = part(h, training=False)
            # dOut/dIn over the whole batch: (batch x out) x (batch x in) entries.
            largest = max(largest, int(np.prod(out.shape)) * int(np.prod(np.shape(h))))
            h = out
        # Past `max_jacobian_entries` the Jacobian way is not run: that it
        # would not fit is the lesson's point, not a failure.
        formed = largest <= jacobian.max_jacobian_entries
        for method, backprop in (("vjp", vjp), ("jacobian", jacobian)):
            runs = method == "vjp" or formed
            cost_rows.append(
                {
                    "input_size": size,
                    "jacobian_entries": largest,
                    "method": method,
                    "milliseconds": (
                        _median_ms(lambda b=backprop, x=x, y=y: b(x, y), repeats)
                        if runs
                        else float("nan")
                    ),
                    "jacobian_megabytes": largest * 4 / 2**20 if method == "jacobian" else 0.0,
                    "formed": runs,
                }
            )
        if index:
            continue
        chained = vjp(x, y)
        by_jacobian = jacobian(x, y) if formed else None
        loss = chained.loss
        joint = iter(_joint_gradients(parts, x, y, loss_fn))
        for number, part in enumerate(parts):
            upstream = chained.upstream[number].numpy()
            parts_rows.append(
                {
                    "part": number + 1,
                    "layers": ", ".join(layer.name for layer in part.layers),
                    "output_shape": str(tuple(upstream.shape)),
                    "upstream_l2_norm": float(np.linalg.norm(upstream)),
                    "upstream_max_abs": float(np.abs(upstream).max()),
                    "weight_grad_l2_norm": float(
                        np.sqrt(sum(np.sum(g.numpy() ** 2) for g in chained[number]))
                    ),
                }
            )
            by_jacobian_part = (
                by_jacobian[number] if by_jacobian is not None else [None] * len(chained[number])
            )
            for variable, g_vjp, g_jac in zip(
                part.trainable_variables, chained[number], by_jacobian_part, strict=True
            ):
                reference = next(joint).numpy()
                agreement_rows.append(
                    {
                        "part": number + 1,
                        "variable": variable.path,
                        "vjp": float(np.abs(g_vjp.numpy() - reference).max()),
                        "jacobian": (
                            float("nan")
                            if g_jac is None
                            else float(np.abs(g_jac.numpy() - reference).max())
                        ),
                    }
                )
    return SplitLesson(
        pd.DataFrame(parts_rows), pd.DataFrame(agreement_rows), pd.DataFrame(cost_rows), loss
    )
