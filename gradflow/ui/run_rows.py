"""What the server has read of each run, shared by every browser session that shows it.

The live panel reads a run's rows once and then only the rows newer than
the last step read (`gradflow.ui.live`). Those rows used to be kept per
browser session: a 40,000-step run took about 165 MB of the server's memory
for every tab that showed it (thirty-sixth session's audit), so a class
watching the teacher's long run held thirty copies of it, and each tick read
the same new rows thirty times.

Now one `RunRows` per run (and store file) holds them. Each browser session
that shows the run keeps a reference to it in its session state; the
registry holds it weakly, so the rows go when the last session that shows
the run closes or moves to another run.

Writers take the entry's lock and replace whole frames, never change one in
place: a session drawing its charts reads the attributes without the lock
and keeps the frames it got for that drawing, even when another session's
tick appends rows meanwhile.
"""

import dataclasses
import threading
import weakref

import pandas as pd

from gradflow import diagnosis, schema


@dataclasses.dataclass(eq=False)
class RunRows:
    """What the server has read of one run.

    Attributes:
        layer_stats: The run's statistics rows read so far.
        metrics: Its metrics rows read so far.
        histograms: Its histogram rows read so far.
        last_step: The newest step in `layer_stats` (0: nothing read).
        found: What the diagnosis rules found in `layer_stats` up to
            `diagnosed_step`.
        diagnosed_step: The newest step the rules have read.
        thresholds: The thresholds of the run's alerts
            (`diagnosis.run_thresholds`), read once.
        layer_inputs: Which recorded layer reads which
            (`diagnosis.run_layer_inputs`), read with the thresholds.
        read_after_end: Whether the metrics were read once more after the
            run ended (the last validation results come after the last
            statistics).
        loaded: Whether the whole run was read once.
        lock: Held while the rows are read or the rules run.
    """

    layer_stats: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=list(schema.LAYER_STATS_COLUMNS))
    )
    metrics: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=list(schema.METRICS_COLUMNS))
    )
    histograms: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    last_step: int = 0
    found: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=list(schema.EVENTS_COLUMNS))
    )
    diagnosed_step: int = 0
    thresholds: diagnosis.Thresholds | None = None
    layer_inputs: dict | None = None
    read_after_end: bool = False
    loaded: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)


_SHARED = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def shared_rows(store_path, run_id):
    """The `RunRows` of `run_id` in the store at `store_path`, made if no session holds one.

    The caller keeps the returned object for as long as it shows the run:
    the registry does not keep it alive.
    """
    key = (str(store_path), run_id)
    with _SHARED_LOCK:
        rows = _SHARED.get(key)
        if rows is None:
            rows = _SHARED[key] = RunRows()
        return rows


def runs_held():
    """The (store path, run id) pairs whose rows some session holds now (for tests and benches)."""
    with _SHARED_LOCK:
        return sorted(_SHARED.keys())
