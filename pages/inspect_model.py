"""Inspect your model: the gradients of one batch for a built-in or uploaded Keras model."""

import streamlit as st

from gradflow.ui import inspect
from gradflow.ui.charts import presentation_style

st.title("Inspect your model")
st.caption(
    "Weight gradients, dLoss/d(output) of every layer, and each layer's sensitivity to the input, "
    "for one batch and without changing the weights. Uploads take models built from core Keras "
    "layers (Sequential or Functional, RNNs too); a subclassed model is your own Python class, "
    "which an upload cannot run safely: see the built-in examples, or call "
    "`gradflow.snapshot(model, x, y)` in your own script."
)
presentation_style()
inspect.model_source()
inspect.snapshot_report()
