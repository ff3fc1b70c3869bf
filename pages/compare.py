"""Compare: two or more runs side by side on one colour scale (relu vs sigmoid)."""

import streamlit as st

from gradflow.ui import compare, controls
from gradflow.ui.charts import presentation_style

st.title("Compare")
st.caption("The same network with one difference, side by side, on one shared colour scale.")

config = controls.training_form()
presentation_style()
compare.preset_pairs()
compare.ab_launcher(config)
st.divider()
compare.comparison(compare.run_picker())
