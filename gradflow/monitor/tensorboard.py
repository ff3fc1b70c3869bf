"""Write the monitor's statistics as TensorBoard summaries.

TensorBoard's own `tf.summary.scalar` and `tf.summary.histogram` live in the
`tensorboard` package, which gradflow does not require. Both are thin layers
over TensorFlow's `tf.summary.write` with a plugin name in the metadata, so we
write the same records directly: a scalar tensor for the "scalars" plugin and
a `[bins, 3]` (left edge, right edge, count) tensor for the "histograms"
plugin. TensorBoard reads them like its own.
"""

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from gradflow import schema

# Per-layer statistics written as scalars (the rest stay in the store).
SCALAR_COLUMNS = ("l2_norm", "max_abs", "weight_norm", "update_ratio", "l2_norm_clipped")
# The metrics whose NaN means "does not apply" (a batch that only
# accumulates its gradient is not clipped); any other NaN is training's.
NAN_MEANS_NOT_APPLICABLE = ("global_norm_clipped", "clipped")


def _metadata(plugin_name):
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin_name)
    )


def _log10_edges():
    # The open end bins get one bin width so TensorBoard can draw them.
    inner = schema.HISTOGRAM_LOW + schema.HISTOGRAM_BIN_WIDTH * np.arange(schema.HISTOGRAM_BINS - 1)
    edges = np.concatenate(
        [
            [schema.HISTOGRAM_LOW - schema.HISTOGRAM_BIN_WIDTH],
            inner,
            [schema.HISTOGRAM_HIGH + schema.HISTOGRAM_BIN_WIDTH],
        ]
    )
    return edges[:-1], edges[1:]


class SummaryWriter:
    """Write layer statistics, metrics and histograms to a TensorBoard log dir.

    Tags: `gradients/<layer>/<tensor>/<statistic>`, `gradflow/<metric>` and
    `log10_abs_gradient/<layer>/<tensor>` (a histogram over log10|g|).

    A NaN that means "does not apply" (no update ratio at a layer's first
    step, no clipped norm without clipping) is left out; a NaN of a broken
    step is written, with `gradients/<layer>/<tensor>/nonfinite` (the count
    of NaN/Inf entries), so TensorBoard's curves show the step that broke
    instead of ending before it.

    Args:
        logdir: The folder TensorBoard reads (`tensorboard --logdir ...`).
    """

    def __init__(self, logdir):
        self._writer = tf.summary.create_file_writer(str(logdir))
        self._scalar = _metadata("scalars")
        self._histogram = _metadata("histograms")
        self._left, self._right = _log10_edges()

    def write(self, layer_stats, metrics, histograms=None):
        """Write tidy frames (see `gradflow.monitor.records`) as summaries.

        Args:
            layer_stats: Tidy layer-statistics DataFrame.
            metrics: Long metrics DataFrame (`step, name, value`).
            histograms: Optional list of `(step, layer, tensor, counts)`.
        """
        with self._writer.as_default():
            for row in layer_stats.itertuples(index=False):
                broken = getattr(row, "nonfinite", 0) > 0
                columns = SCALAR_COLUMNS + (("nonfinite",) if broken else ())
                for column in columns:
                    value = getattr(row, column)
                    if np.isnan(value) and not broken:
                        continue
                    self._scalar_at(f"gradients/{row.layer}/{row.tensor}/{column}", value, row.step)
            for row in metrics.itertuples(index=False):
                self._metric(row.step, row.name, row.value)
            for step, layer, tensor, counts in histograms or ():
                buckets = np.stack([self._left, self._right, counts], axis=1)
                tf.summary.write(
                    f"log10_abs_gradient/{layer}/{tensor}",
                    tf.constant(buckets, tf.float64),
                    step=int(step),
                    metadata=self._histogram,
                )

    def write_metrics(self, step, values):
        """Write `{name: value}` of one step (compiled and validation metrics) as `gradflow/<name>`."""
        with self._writer.as_default():
            for name, value in values.items():
                self._metric(step, name, value)

    def _metric(self, step, name, value):
        if np.isnan(value) and name in NAN_MEANS_NOT_APPLICABLE:
            return
        self._scalar_at(f"gradflow/{name}", value, step)

    def _scalar_at(self, tag, value, step):
        tf.summary.write(tag, tf.constant(value, tf.float32), step=int(step), metadata=self._scalar)

    def close(self):
        self._writer.flush()
        self._writer.close()
