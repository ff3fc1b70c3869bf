"""Live training (home): choose a network, press Start training, watch its gradients."""

import streamlit as st

from gradflow.ui import controls, live
from gradflow.ui.charts import presentation_style

st.title("Live training")
st.caption(
    "Per-layer gradient maxima and norms of a network while it trains, updated every second."
)

config = controls.training_form()
presentation_style()
live.live_page(config)
