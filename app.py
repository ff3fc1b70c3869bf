"""gradflow dashboard: watch gradients flow through a network while it trains.

Start with `streamlit run app.py` (or `gradflow serve`).
"""

import streamlit as st

st.set_page_config(page_title="gradflow", page_icon="📉", layout="wide")

st.title("gradflow")
st.markdown(
    "See how **gradients flow** through a neural network while it trains: per-layer "
    "gradient maxima and norms, live, as heatmaps (layer × step) and line charts."
)
