"""Plotly figures of gradient statistics, built from tidy DataFrames.

Imports neither TensorFlow nor Streamlit: the dashboard, the CLI exporter
and a notebook all draw the same pictures from the run store's DataFrames.
Every builder returns a `Chart` (`.figure` and `.data`, the exact values
drawn) and takes `presentation=True` for slide-sized fonts.

Example:

```python
from gradflow import figures
chart = figures.heatmap(run.layer_stats, "max_abs", tensor="kernel")
st.plotly_chart(chart.figure, config=figures.PLOTLY_CONFIG)
```
"""

from gradflow.figures.chart import Chart
from gradflow.figures.compare import compare_heatmaps, compare_metrics, compare_profiles
from gradflow.figures.decimate import decimate_envelope, decimate_max
from gradflow.figures.grid import ALL_WEIGHTS, LayerGrid, layer_grid
from gradflow.figures.heatmap import heatmap, heatmaps_on_one_scale
from gradflow.figures.histogram import BIN_COLUMNS, histogram_heatmap
from gradflow.figures.lines import layer_lines, metrics_chart
from gradflow.figures.profile import profile
from gradflow.figures.style import OKABE_ITO, PLOTLY_CONFIG, apply_style, escape_label
from gradflow.schema import tensor_kind

__all__ = [
    "ALL_WEIGHTS",
    "BIN_COLUMNS",
    "Chart",
    "LayerGrid",
    "OKABE_ITO",
    "PLOTLY_CONFIG",
    "apply_style",
    "compare_heatmaps",
    "compare_metrics",
    "compare_profiles",
    "decimate_envelope",
    "decimate_max",
    "escape_label",
    "heatmap",
    "heatmaps_on_one_scale",
    "histogram_heatmap",
    "layer_grid",
    "layer_lines",
    "metrics_chart",
    "profile",
    "tensor_kind",
]
