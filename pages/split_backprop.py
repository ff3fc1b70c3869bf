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
if st.button("Run the lesson", type="primary", disabled=not sizes, help="Pick one size or more."):
    from gradflow.probe.split_lesson import split_backprop_lesson

    with st.spinner("Backpropagating both ways and timing them…"):
        st.session_state["split.lesson"] = split_backprop_lesson(sizes=sorted(sizes))
        st.session_state["split.sizes"] = sorted(sizes)
lesson = st.session_state.get("split.lesson")
if lesson is not None:
    shown = st.session_state["split.sizes"]
    if shown != sorted(sizes):
        st.info(
            f"These results are for the sizes {', '.join(map(str, shown))}: press "
            "**Run the lesson** for the sizes picked now."
        )
    st.subheader("What each part receives from above")
    st.caption(f"A batch of 8 inputs of {shown[0]}×{shown[0]} pixels, the smallest size picked.")
    st.dataframe(lesson.parts, hide_index=True)
    st.subheader("Chained tapes against one joint tape")
    worst = lesson.agreement[["vjp", "jacobian"]].max()
    if worst.isna()["jacobian"]:
        agreement = (
            f"Largest difference from one joint tape: {worst['vjp']:.1e} with chained VJPs, "
            "the same gradients up to float32 rounding. The Jacobians are too large to form "
            "at this size, so the Jacobian way was not run."
        )
    else:
        agreement = (
            f"Largest difference from one joint tape: {worst['vjp']:.1e} (VJP), "
            f"{worst['jacobian']:.1e} (Jacobians): the same gradients, up to float32 rounding."
        )
    st.success(agreement)
    st.dataframe(lesson.agreement, hide_index=True)
    st.subheader("Why nobody multiplies full Jacobians")
    show_chart(jacobian_cost(lesson.cost, presentation=presentation), "split.cost")
    st.dataframe(lesson.cost, hide_index=True)
