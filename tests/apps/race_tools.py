"""Streamlit internals that the race apps in this folder use to force a race on purpose.

Only these test apps touch Streamlit's private objects; gradflow itself uses
the public API.
"""

from streamlit.proto.ClientState_pb2 import ClientState
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx


def this_session():
    """(script run context, AppSession) of the running script."""
    ctx = get_script_run_ctx()
    return ctx, Runtime.instance()._session_mgr.get_active_session_info(ctx.session_id).session


def tick(ctx, fragment_id):
    """The rerun request a browser's `run_every` timer sends for `fragment_id`."""
    return ClientState(
        fragment_id=fragment_id,
        is_auto_rerun=True,
        query_string=ctx.query_string,
        page_script_hash=ctx.page_script_hash,
    )
