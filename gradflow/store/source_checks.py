"""Checks on a run store from someone else, before `gradflow import` copies its runs.

A teacher imports the stores the class mails in: files from strangers, into
the store the dashboard serves. gradflow's readers trust what its own writers
wrote (blob lengths, series ids, JSON, statuses); a crafted file copied as it
was broke every page of the class store (tags that were not JSON), labelled
every row of a run `output/bias` (series ids that name no series), asked
for 8 TiB (a series id of 2**40), or filled the disk (a view named like a
table). So every row is checked against what gradflow writes, and a store
that holds one it would not write is refused whole, before anything is copied.

Example:

```python
check_schema(conn, "alice.db")                # the six tables, as tables, with their columns
run = check_run(row, "alice.db")              # a `runs` row as a dict, checked
```
"""

import functools
import json
import math
import sqlite3

import numpy as np

from gradflow import schema
from gradflow.store import blocks, tables
from gradflow.store.store import _RUN_ID, MAX_NAME_LENGTH, shortened
from gradflow.store.trouble import NotARunStoreError

# The tables a run's rows are in: each must be a table (a view may compute
# anything, forever) with at least the columns this gradflow writes.
RUN_TABLES = ("runs", "series", "layer_stats", "metrics", "events", "histograms")

# Caps on what a row may hold: far above what gradflow writes, far below what
# would fill a page or a disk.
MAX_TEXT = 10_000  # characters of a message, a layer or variable name, a host: longer ones are cut
MAX_METRIC_NAME = 200
MAX_JSON_BYTES = 1_000_000  # of a config, or of the tags
MAX_SERIES_ID = 2**20  # a run's series are numbered from 0: a million layers' tensors
MAX_COUNT = 2**52  # entries of one tensor in one histogram bin


class UntrustedStoreError(NotARunStoreError):
    """The source holds something gradflow does not write: damaged, or made to harm."""


def check_schema(conn, path):
    """Refuse a source whose run tables are not tables with this gradflow's columns."""
    for table in RUN_TABLES:
        row = conn.execute("SELECT type FROM sqlite_master WHERE name = ?", (table,)).fetchone()
        if row is None or row[0] != "table":
            _refuse(path, f"its `{table}` is {'missing' if row is None else 'a ' + row[0]}")
        columns = {info[1] for info in conn.execute(f"PRAGMA table_info({table})")}
        missing = sorted(_expected_columns()[table] - columns)
        if missing:
            _refuse(path, f"its `{table}` table has no column {', '.join(missing)}")


def check_no_views_or_triggers(conn, path):
    """Refuse a source with views or triggers: gradflow makes none."""
    row = conn.execute(
        "SELECT type, name FROM sqlite_master WHERE type IN ('view', 'trigger') LIMIT 1"
    ).fetchone()
    if row is not None:
        _refuse(path, f"a {row[0]} ({_shown(row[1])}), which gradflow never makes")


@functools.cache
def _expected_columns():
    conn = sqlite3.connect(":memory:")
    try:
        tables.create_tables(conn)
        return {
            table: {info[1] for info in conn.execute(f"PRAGMA table_info({table})")}
            for table in RUN_TABLES
        }
    finally:
        conn.close()


def check_run(row, path):
    """A `runs` row (a dict of `transfer.RUN_COLUMNS` and `id`), checked; returns it.

    What an older gradflow let through, or a long failure message, is
    mended rather than refused, as the store shows it: a name of control
    characters or bidirectional overrides (a tab, pasted right-to-left text)
    gets U+FFFD for them, and a name or a message too long is cut.
    """
    run_id = row["run_id"]
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        _refuse(path, f"a run id {_shown(run_id)} is not one gradflow makes")
    row["name"] = _name(row["name"], path, f"run {run_id}")
    if row["status"] not in tables.STATUSES:
        _refuse(path, f"run {run_id}'s status {_shown(row['status'])} is not one of gradflow's")
    if row["source"] not in tables.SOURCES:
        _refuse(path, f"run {run_id}'s source {_shown(row['source'])} is not one of gradflow's")
    for column in ("created_at", "updated_at"):
        _time(row[column], path, f"run {run_id}'s {column}")
    if row["heartbeat_at"] is not None:
        _time(row["heartbeat_at"], path, f"run {run_id}'s heartbeat_at")
    _whole(row["progress_step"], path, f"run {run_id}'s progress_step")
    for column in ("total_steps", "pid"):
        if row[column] is not None:
            _whole(row[column], path, f"run {run_id}'s {column}")
    for column in ("message", "host"):
        if row[column] is not None:
            row[column] = _text(row[column], path, f"run {run_id}'s {column}")
    tags = _json(row["tags"], path, f"run {run_id}'s tags", MAX_JSON_BYTES)
    # What `RunStore.tag` takes: a list of non-empty strings.
    if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
        _refuse(path, f"run {run_id}'s tags are not a list of names")
    if not isinstance(_json(row["config"], path, f"run {run_id}'s config", MAX_JSON_BYTES), dict):
        _refuse(path, f"run {run_id}'s config is not a JSON object")
    return row


def check_series(rows, path, run_id):
    """The run's `series` rows, checked; returns them and the set of their ids."""
    ids, checked = set(), []
    for series, layer, layer_index, tensor, variable in rows:
        # The readers size an array by the largest id: 2**31 asked for 16 GiB.
        _whole(series, path, f"run {run_id}'s series id", most=MAX_SERIES_ID)
        _whole(layer_index, path, f"run {run_id}'s layer_index", most=MAX_SERIES_ID)
        names = [
            _text(value, path, f"run {run_id}'s {what} name")
            for what, value in (("layer", layer), ("tensor", tensor), ("variable", variable))
        ]
        ids.add(series)
        checked.append((series, names[0], layer_index, *names[1:]))
    return ids, checked


def checked_blocks(rows, path, run_id, series_ids):
    """Yield the run's `layer_stats` rows (`last_step, steps, series, *statistics`), checked."""
    for row in rows:
        last_step, steps, series, *values = row
        where = f"run {run_id}'s layer statistics"
        _whole(last_step, path, where + " (last step)")
        blobs = (steps, series, *values)
        if not all(isinstance(blob, bytes) for blob in blobs):
            _refuse(path, f"{where} hold a value that is not a block")
        count, rest = divmod(len(steps), blocks.STEP_DTYPE.itemsize)
        if rest or not 0 < count <= tables.BLOCK_ROWS:
            _refuse(path, f"{where} hold a block of {len(steps)} bytes of steps")
        if len(series) != count * blocks.SERIES_DTYPE.itemsize or any(
            len(value) != count * blocks.VALUE_DTYPE.itemsize for value in values
        ):
            _refuse(path, f"{where} hold a block whose columns differ in length")
        step_array = np.frombuffer(steps, dtype=blocks.STEP_DTYPE)
        if step_array.min() < 0 or step_array.max() != last_step:
            _refuse(path, f"{where} hold a block whose steps disagree with its last step")
        if not set(np.unique(np.frombuffer(series, dtype=blocks.SERIES_DTYPE)).tolist()) <= (
            series_ids
        ):
            _refuse(path, f"{where} name a series the run does not have")
        yield row


def checked_metrics(rows, path, run_id):
    """Yield the run's `metrics` rows (`step, name, value`), checked."""
    for step, name, value in rows:
        _whole(step, path, f"run {run_id}'s metric step")
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= MAX_METRIC_NAME
            or schema.CONTROL_CHARACTERS.search(name)
            or schema.BIDI_CONTROLS.search(name)
        ):
            _refuse(path, f"run {run_id} has a metric named {_shown(name)}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            _refuse(path, f"run {run_id}'s metric {name!r} holds {_shown(value)}")
        yield step, name, value


def checked_events(rows, path, run_id):
    """Yield the run's `events` rows (`step, layer, kind, message`), checked."""
    for step, layer, kind, message in rows:
        _whole(step, path, f"run {run_id}'s event step")
        if kind not in schema.EVENT_KINDS:
            _refuse(path, f"run {run_id} has an event of kind {_shown(kind)}")
        layer = _text(layer, path, f"run {run_id}'s event layer")
        yield step, layer, kind, _text(message, path, f"run {run_id}'s event message")


def checked_histograms(rows, path, run_id, series_ids):
    """Yield the run's `histograms` rows (`step, series, counts`), checked."""
    size = schema.HISTOGRAM_BINS * 8
    for step, series, counts in rows:
        _whole(step, path, f"run {run_id}'s histogram step")
        if series not in series_ids:
            _refuse(path, f"run {run_id}'s histograms name a series the run does not have")
        if not isinstance(counts, bytes) or len(counts) != size:
            _refuse(path, f"run {run_id}'s histograms hold counts of the wrong size")
        values = np.frombuffer(counts, dtype="<i8")
        # Counts of entries: a float's bytes read as one are negative or above 2**52.
        if values.min() < 0 or values.max() > MAX_COUNT:
            _refuse(path, f"run {run_id}'s histograms hold counts that are not counts")
        yield step, series, counts


def checked_deletions(rows, path):
    """The source's `deleted_runs` rows, checked: `(run_id, name, created_at, deleted_at)`.

    Read only when a whole store moves into an empty one (`copy_runs`): its
    deletions go with it. A name is mended as `check_run` mends a run's.
    """
    for run_id, name, created_at, deleted_at in rows:
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            _refuse(path, f"a deleted run's id {_shown(run_id)} is not one gradflow makes")
        name = _name(name, path, f"deleted run {run_id}")
        _time(created_at, path, f"deleted run {run_id}'s creation time")
        _time(deleted_at, path, f"deleted run {run_id}'s deletion time")
        yield run_id, name, created_at, deleted_at


def _refuse(path, what):
    raise UntrustedStoreError(
        f"{str(path)!r} holds what gradflow does not write: {what}. It is damaged, or was "
        "made by hand; nothing was copied. Ask its sender for a new copy "
        "(`gradflow export RUN_ID --format store`)."
    )


def _shown(value):
    """A value for the message: short, and without what would act on a terminal."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(value, path, what, most=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _refuse(path, f"{what} is {_shown(value)}, not a whole number")
    if most is not None and value >= most:
        _refuse(path, f"{what} is {_shown(value)}, not below {most:,}")


def _time(value, path, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _refuse(path, f"{what} is {_shown(value)}, not a time")


def _name(value, path, owner):
    """A run's name as the store shows it: control characters and bidirectional
    overrides (a tab, pasted right-to-left text) as U+FFFD, cut to its length."""
    if not isinstance(value, str):
        _refuse(path, f"{owner}'s name {_shown(value)} is not a name")
    if not value.strip():
        value = "(no name)"  # `create_run(name=" ")` stores a blank one
    value = schema.BIDI_CONTROLS.sub("\ufffd", schema.CONTROL_CHARACTERS.sub("\ufffd", value))
    return _cut(value, MAX_NAME_LENGTH)


def _text(value, path, what):
    """`value`, a string, cut to `MAX_TEXT` (a failure's whole traceback, written by a script)."""
    if not isinstance(value, str):
        _refuse(path, f"{what} is {_shown(value)}, not a text")
    return _cut(value, MAX_TEXT)


def _cut(text, most):
    return shortened(text, most)


def _json(value, path, what, most):
    if not isinstance(value, str) or len(value) > most:
        _refuse(path, f"{what}: not JSON of at most {most:,} characters")
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        _refuse(path, f"{what}: not JSON gradflow can read")
