"""`Chart`: a Plotly figure together with the exact data it plots."""

import dataclasses

import pandas as pd
import plotly.graph_objects as go

from gradflow.figures import style


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

    def for_run(self, run):
        """A copy of this chart that names its run, for files that leave the dashboard.

        On the page a chart sits under its run's name; a PNG on a slide or a
        CSV in a handout does not, and two runs' heatmaps look alike. The
        copy's figure carries the name as its subtitle, its `data` a leading
        `run` column (as the Compare page's charts have), and its `title`
        reads `"<title> (<run>)"`. This chart is left as it is.

        Example:

        ```python
        handout = figures.heatmap(stats, "max_abs").for_run("relu · depth 20")
        handout.figure.write_image("relu.png")
        ```

        Args:
            run: the run's name (shown literally, even if it holds `<b>`).

        Returns:
            A new `Chart`.
        """
        run = str(run)
        figure = go.Figure(self.figure)
        # Plotly's default subtitle is small beside a slide's fonts.
        size = figure.layout.font.size or 13
        figure.update_layout(
            title_subtitle_text=style.escape_label(run),
            title_subtitle_font_size=size,
            # Room for the subtitle's line, which would touch the plot; the
            # title pinned to the top, clear of subplot titles above the plots.
            margin_t=(figure.layout.margin.t or 60)
            + (2 if figure.layout.annotations else 1) * size,
            title_yref="container",
            title_y=1.0,
            title_yanchor="top",
            title_pad_t=size // 2,
        )
        if figure.layout.title.text is None:
            # A subtitle alone is not drawn: give it a title line to hang from.
            figure.update_layout(title_text=style.escape_label(self.title or run))
        data = self.data.copy()
        if "run" not in data.columns:
            data.insert(0, "run", run)
        title = f"{self.title} ({run})" if self.title else run
        return Chart(figure, data, title, self.description)
