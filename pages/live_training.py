"""Live training (home): choose a network, press Start training, watch its gradients."""

import streamlit as st

from gradflow.ui import controls, live
from gradflow.ui.charts import presentation_style

st.title("Live training")
st.caption("Per-layer gradient maxima and norms of a network while it trains, updated every second.")

config = controls.training_form()
presentation_style()
# Each part that ends in a polling fragment (the trainer-readiness line, the
# live panel) gets a container of its own, so that each fragment is the last
# element of its block and alone there. Otherwise a Streamlit race under load
# crashes the browser's page and freezes it (issue #7): see
# gradflow/ui/fragments.py, and docs/freeze-fix.patch for the same fix
# inside gradflow/ui/live.py.
with st.container():
    live.control_buttons(config)
with st.container():
    live.live_panel()
