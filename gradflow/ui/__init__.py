"""The Streamlit UI layer: the only part of gradflow (with app.py and pages/) that imports streamlit.

Pages stay thin: widgets, one gradflow call, a chart. What they share lives here:
`resources` (one run store and one run manager per server), `controls` (the
training form), `live` (the live panel), `charts` (a figure with its exports).
"""

import pathlib

# The browser tab's icon, a heatmap glyph (app.py). A local file: a Material
# icon there makes every page load fetch it from fonts.gstatic.com, which an
# offline classroom server's students may not reach.
FAVICON = pathlib.Path(__file__).with_name("favicon.png")
