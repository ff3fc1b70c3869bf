"""`Chart`: a Plotly figure together with the exact data it plots."""

import dataclasses

import pandas as pd
import plotly.graph_objects as go


@dataclasses.dataclass
class Chart:
    """A figure and the tidy DataFrame of exactly what it draws.

    Every builder in `gradflow.figures` returns a `Chart`, so that what a
    person sees can be exported as CSV without recomputing anything: after
    decimation `data` holds the decimated values, one row per drawn point or
    cell, with non-finite values kept as NaN/Inf.

    Example:

    ```python
    chart = gradflow.figures.heatmap(run.layer_stats, "max_abs")
    st.plotly_chart(chart.figure, config=gradflow.figures.PLOTLY_CONFIG)
    chart.data.to_csv("max_abs.csv", index=False)
    ```

    Attributes:
        figure: the `plotly.graph_objects.Figure`.
        data: the plotted values as a tidy DataFrame.
        title: a short plain-text title (not escaped; for file names and
            READMEs).
        description: one or two sentences saying how to read the figure.
    """

    figure: go.Figure
    data: pd.DataFrame
    title: str = ""
    description: str = ""
