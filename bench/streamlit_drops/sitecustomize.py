"""Counts the script-run messages Streamlit drops, for `bench_classroom.py --count-dropped-events`.

On the bench's server only (its folder is put on the server's PYTHONPATH):
wraps `AppSession._handle_scriptrunner_event_on_event_loop`, which ignores
the events of a script runner that is no longer the session's current one
(Streamlit 1.67 logs that at debug level only), and prints one line per
dropped event: `DROP <time> <session> <event> <message type>`. Other Python
processes that see this folder (the workers) are left alone.
"""

import sys
import time

if "streamlit" in sys.orig_argv[:3]:
    from streamlit.runtime import app_session as _app_session

    _handle = _app_session.AppSession._handle_scriptrunner_event_on_event_loop

    def _counting(self, sender, event, *args, **kwargs):
        if sender is not None and sender is not self._scriptrunner:
            message = kwargs.get("forward_msg", args[0] if args else None)
            kind = message.WhichOneof("type") if message is not None else ""
            if kind == "delta":
                kind += ":fragment" if message.delta.fragment_id else ":main"
            print(f"DROP {time.time():.3f} {self.id[:8]} {event.name} {kind}", flush=True)
        return _handle(self, sender, event, *args, **kwargs)

    _app_session.AppSession._handle_scriptrunner_event_on_event_loop = _counting
