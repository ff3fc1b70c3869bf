"""Inspect your model: the gradients of one batch for a built-in or uploaded Keras model."""

import streamlit as st

from gradflow.ui import inspect
from gradflow.ui.charts import presentation_style

st.title("Inspect your model")
st.caption(
    "Weight gradients, dLoss/d(output) of every layer, and each layer's sensitivity to the input, "
    "for one batch and without changing the weights. Works for subclassed models and RNNs too."
)
presentation_style()
inspect.model_source()
inspect.snapshot_report()
