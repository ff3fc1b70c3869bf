"""The Streamlit UI layer: the only part of gradflow (with app.py and pages/) that imports streamlit.

Pages stay thin: widgets, one gradflow call, a chart. What they share lives here:
`resources` (one run store and one run manager per server), `controls` (the
training form), `live` (the live panel), `charts` (a figure with its exports).
"""
