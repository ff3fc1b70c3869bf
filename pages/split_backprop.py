"""Split backprop: one tape per part, chained with output_gradients, against one joint tape."""

import streamlit as st

from gradflow.figures.lessons import jacobian_cost
from gradflow.ui.charts import presentation_style, show_chart

st.title("Split backprop")
st.markdown(
    "A small CNN is cut into three parts: **Conv2D → Conv2D → Flatten/Dense/sigmoid**, with MSE loss. "
    "Each part has its own `GradientTape`; each tape gets the gradient from the part above through "
    "`output_gradients` (a vector-Jacobian product). The result equals one tape over the whole model."
)
presentation = presentation_style()
sizes = st.multiselect(
    "Input sizes (pixels per side)", [6, 8, 10, 12, 14, 16], default=[6, 8, 10, 12]
)
if st.button("Run the lesson", type="primary", disabled=not sizes):
    from gradflow.probe.split_lesson import split_backprop_lesson

    with st.spinner("Backpropagating both ways and timing them…"):
        st.session_state["split.lesson"] = split_backprop_lesson(sizes=sorted(sizes))
lesson = st.session_state.get("split.lesson")
if lesson is not None:
    st.subheader("What each part receives from above")
    st.dataframe(lesson.parts, hide_index=True)
    st.subheader("Chained tapes against one joint tape")
    worst = lesson.agreement[["vjp", "jacobian"]].max()
    jacobians = (
        "the Jacobians too large to form at this size"
        if worst.isna()["jacobian"]
        else f"{worst['jacobian']:.1e} (Jacobians)"
    )
    st.success(
        f"Largest difference from one joint tape: {worst['vjp']:.1e} (VJP), {jacobians}: "
        "the same gradients, up to float32 rounding."
    )
    st.dataframe(lesson.agreement, hide_index=True)
    st.subheader("Why nobody multiplies full Jacobians")
    show_chart(jacobian_cost(lesson.cost, presentation=presentation), "split.cost")
    st.dataframe(lesson.cost, hide_index=True)
