"""Copying runs between run stores (`gradflow.store.transfer`): whole runs, once, read-only sources."""

import hashlib
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from gradflow import schema
from gradflow.store import (
    NewerStoreError,
    RunStore,
    UnknownRunError,
    source_checks,
    tables,
    transfer,
)
from gradflow.store.transfer import RunIdConflictError, copy_runs, export_runs
from tests.test_store import tidy_rows
from tests.test_store_format import V1_ROWS, write_v1_store, write_v2_store


def fill(store, name="relu", status="completed", step_scale=1.0):
    """A run with every kind of row: two flushes of overlapping statistics, NaN and inf too."""
    run_id = store.create_run({"depth": 2, "activation": name}, name=name, tags=["class"])
    first = tidy_rows([1, 2])
    first.loc[1, "max_abs"] = np.nan
    first.loc[2, "l2_norm"] = np.inf
    second = tidy_rows([2, 3]) * 1  # step 2 again: the later block must win
    second["max_abs"] = second["max_abs"] * step_scale + 100.0
    counts = np.arange(schema.HISTOGRAM_BINS, dtype=np.int64)
    with store.writer(run_id, background_flush=False) as w:
        w.add_layer_stats(first)
        w.add_metrics(1, {"loss": 0.7, "accuracy": 0.5})
        w.add_event(1, "dense", "vanishing", "first")
        w.add_event(1, "dense_1", "info", "second, same step")
        w.add_histograms(1, [("dense", 0, "kernel", counts), ("dense_1", 1, "kernel", counts * 2)])
        w.flush()
        w.add_layer_stats(second)
        w.add_metrics(3, {"loss": float("nan")})
        w.progress(3)
    store.set_status(run_id, status)
    return run_id


def frames(store, run_id):
    return {
        "layer_stats": store.layer_stats(run_id),
        "metrics": store.metrics(run_id),
        "events": store.events(run_id),
        "histograms": store.histograms(run_id),
    }


def assert_same_run(source, destination, run_id):
    for name, expected in frames(source, run_id).items():
        pd.testing.assert_frame_equal(frames(destination, run_id)[name], expected, obj=name)
    mine, theirs = source.run_info(run_id), destination.run_info(run_id)
    assert mine == theirs


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def source(tmp_path):
    store = RunStore(tmp_path / "alice.db")
    store.ids = [fill(store, "relu"), fill(store, "sigmoid", step_scale=2.0)]
    return store


def test_runs_arrive_whole_with_their_ids_and_other_keys(source, tmp_path):
    destination = RunStore(tmp_path / "class.db")
    mine = fill(destination, "teacher")  # the destination's keys are taken: renumbered
    copies = copy_runs(source.path, destination.path)
    assert [(c.run_id, c.copied, c.status) for c in copies] == [
        (run_id, True, "completed") for run_id in source.ids
    ]
    for run_id in source.ids:
        assert_same_run(source, destination, run_id)
    later = destination.layer_stats(source.ids[0]).query("step == 2")
    assert (later["max_abs"] >= 100).all()  # the later block of step 2, as in the source
    assert set(destination.runs()["run_id"]) == {mine, *source.ids}
    assert len(frames(destination, mine)["layer_stats"]) == 12  # its own rows untouched


def test_only_the_runs_named_and_an_unknown_one_copies_nothing(source, tmp_path):
    target = tmp_path / "class.db"
    copies = copy_runs(source.path, target, [source.ids[1]])
    assert [c.run_id for c in copies] == [source.ids[1]]
    assert list(RunStore(target).runs()["run_id"]) == [source.ids[1]]
    with pytest.raises(UnknownRunError, match="0123456789ab.*alice.db"):
        copy_runs(source.path, target, [source.ids[0], "0123456789ab"])
    assert list(RunStore(target).runs()["run_id"]) == [source.ids[1]]
    with pytest.raises(ValueError, match="run id strings"):
        copy_runs(source.path, target, ["no spaces"])


def test_a_second_import_skips_what_the_first_copied(source, tmp_path):
    target = tmp_path / "class.db"
    copy_runs(source.path, target)
    again = copy_runs(source.path, target)
    assert [(c.run_id, c.copied) for c in again] == [(run_id, False) for run_id in source.ids]
    assert all("already in" in c.note for c in again)
    destination = RunStore(target)
    assert len(destination.runs()) == 2
    for run_id in source.ids:
        assert_same_run(source, destination, run_id)  # nothing doubled


def deletions(path):
    """The `deleted_runs` rows of the store at `path`: run id, name, created_at."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(
            "SELECT run_id, name, created_at FROM deleted_runs ORDER BY run_id"
        ).fetchall()
    finally:
        conn.close()


def test_a_run_deleted_here_stays_deleted_when_its_store_comes_again(source, tmp_path):
    """A teacher deleted a useless run from the class store; the student's store
    imported again the next week brought it back."""
    useless, kept = source.ids
    destination = RunStore(tmp_path / "class.db")
    copy_runs(source.path, destination.path)
    created = destination.run_info(useless)["created_at"]
    destination.delete(useless)
    new = fill(source, "tanh")  # the next week's run
    again = copy_runs(source.path, destination.path)
    assert [(c.run_id, c.copied) for c in again] == [(useless, False), (kept, False), (new, True)]
    skipped = again[0]
    assert skipped.deleted_at is not None and again[1].deleted_at is None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(skipped.deleted_at))
    assert skipped.note == (
        f"deleted from {str(destination.path)!r} on {when}: to bring it back, "
        f"`gradflow import {source.path} {useless} --db {destination.path} --restore-deleted`"
    )
    assert set(destination.runs()["run_id"]) == {kept, new}
    assert deletions(destination.path) == [(useless, "relu", created)]
    # Brought back on purpose: the whole run, and the store forgets its deletion.
    (back,) = copy_runs(source.path, destination.path, [useless], restore_deleted=True)
    assert back.copied and back.deleted_at is None
    assert_same_run(source, destination, useless)
    assert deletions(destination.path) == []
    # Deleted again, it stays out again.
    destination.delete(useless)
    (out,) = copy_runs(source.path, destination.path, [useless])
    assert not out.copied and out.deleted_at is not None
    with pytest.raises(ValueError, match="`restore_deleted` must be True or False, got 'yes'"):
        copy_runs(source.path, destination.path, restore_deleted="yes")


def test_another_run_with_a_deleted_runs_id_is_copied(source, tmp_path):
    """Only the run deleted (the same id and creation time) stays out."""
    destination = RunStore(tmp_path / "class.db")
    copy_runs(source.path, destination.path, [source.ids[0]])
    destination.delete(source.ids[0])
    source.close()
    with sqlite3.connect(source.path) as conn:
        conn.execute(
            "UPDATE runs SET created_at = created_at + 60 WHERE run_id = ?", (source.ids[0],)
        )
    (copy,) = copy_runs(source.path, destination.path, [source.ids[0]])
    assert copy.copied and destination.run_info(source.ids[0])["name"] == "relu"
    assert deletions(destination.path) == []  # the id names a run of this store again


def test_the_sources_own_deletions_are_neither_copied_nor_read(source, tmp_path):
    """Deletions are the store's own: a student's (or rows crafted in their place) do
    not keep runs out of the class store, and an export carries none."""
    destination = RunStore(tmp_path / "class.db")
    copy_runs(source.path, destination.path, [source.ids[0]])
    theirs = fill(source, "theirs, deleted")
    source.delete(source.ids[0], theirs)
    source.close()
    with sqlite3.connect(source.path) as conn:
        conn.execute(
            "INSERT INTO deleted_runs VALUES (?, 'x', 'not a time', x'00')", (source.ids[1],)
        )
        conn.execute("INSERT INTO deleted_runs VALUES ('../x y', 'x', 0, 0)")
    copies = copy_runs(source.path, destination.path)
    assert [(c.run_id, c.copied) for c in copies] == [(source.ids[1], True)]
    assert set(destination.runs()["run_id"]) == {source.ids[0], source.ids[1]}
    assert deletions(destination.path) == []
    # An export of a run from a store with deletions carries none of them.
    destination.delete(source.ids[0])
    sent = tmp_path / "sigmoid.db"
    export_runs(destination.path, sent, [source.ids[1]])
    assert deletions(sent) == []
    assert [c.copied for c in copy_runs(sent, tmp_path / "bob.db")] == [True]


def test_a_whole_store_moved_to_a_new_file_keeps_its_deletions(source, tmp_path):
    """The teacher moved class.db to a new machine; the next week Alice's store came
    again and brought back the run deleted before the move."""
    useless, kept = source.ids
    old = RunStore(tmp_path / "class.db")
    copy_runs(source.path, old.path)
    old.delete(useless)
    moved = copy_runs(old.path, tmp_path / "new.db")
    assert [(c.run_id, c.copied) for c in moved] == [(kept, True)]
    assert moved.deletions == 1
    assert deletions(tmp_path / "new.db") == deletions(old.path) != []
    again = copy_runs(source.path, tmp_path / "new.db")
    assert [(c.run_id, c.copied) for c in again] == [(useless, False), (kept, False)]
    assert again[0].deleted_at is not None and again.deletions == 0
    # Not into a store that holds runs (the class's own deletions there are the
    # teacher's), nor when only some runs are copied.
    busy = RunStore(tmp_path / "busy.db")
    fill(busy, "the teacher's own")
    assert copy_runs(old.path, busy.path).deletions == 0
    assert deletions(busy.path) == []
    assert copy_runs(old.path, tmp_path / "some.db", [kept]).deletions == 0
    assert deletions(tmp_path / "some.db") == []


def test_a_crafted_deletion_refuses_a_move_and_one_of_a_run_still_there_is_left_out(
    source, tmp_path
):
    source.close()
    with sqlite3.connect(source.path) as conn:
        # A deletion of a run the store still holds (made by hand): the run wins.
        conn.execute("INSERT INTO deleted_runs VALUES (?, 'relu', 0, 1)", (source.ids[0],))
    moved = copy_runs(source.path, tmp_path / "new.db")
    assert [c.copied for c in moved] == [True, True] and moved.deletions == 0
    assert deletions(tmp_path / "new.db") == []
    for row, why in (
        ("'0123456789ab', 'x', 'not a time', 1", "deleted run 0123456789ab's creation time"),
        ("'../x y', 'x', 0, 0", "a deleted run's id '../x y'"),
    ):
        with sqlite3.connect(source.path) as conn:
            conn.execute("DELETE FROM deleted_runs")
            conn.execute(f"INSERT INTO deleted_runs VALUES ({row})")
        target = tmp_path / f"new-{len(why)}.db"
        with pytest.raises(source_checks.UntrustedStoreError, match=re.escape(why)):
            copy_runs(source.path, target)
        assert RunStore(target).runs().empty and deletions(target) == []  # nothing copied


def test_a_version_2_source_is_read_as_it_is(tmp_path, monkeypatch):
    """Every student's store is of version 2 when version 3 comes: an upgraded temporary
    copy of each would cost its size in temporary space, for a table imports do not read."""
    old = tmp_path / "old.db"
    write_v2_store(old)
    before = digest(old)

    def no_copy(path):
        raise AssertionError(f"{path} was upgraded in a copy")

    monkeypatch.setattr(transfer, "_upgraded_copy", no_copy)
    (copy,) = copy_runs(old, tmp_path / "class.db")
    assert (copy.run_id, copy.copied) == ("bbbbbbbbbbbb", True)
    assert digest(old) == before
    monkeypatch.undo()
    assert_same_run(RunStore(old), RunStore(tmp_path / "class.db"), "bbbbbbbbbbbb")


def test_an_id_taken_by_another_run_is_refused_and_nothing_copied(source, tmp_path):
    destination = RunStore(tmp_path / "class.db")
    other = destination.create_run({}, name="bob's run")
    conn = sqlite3.connect(destination.path)
    with conn:  # the same id, another run: another creation time
        conn.execute(
            "UPDATE runs SET run_id = ?, created_at = created_at - 3600 WHERE run_id = ?",
            (source.ids[1], other),
        )
    conn.close()
    with pytest.raises(RunIdConflictError, match=rf"{source.ids[1]}.*'sigmoid'.*bob's run"):
        copy_runs(source.path, destination.path)
    runs = destination.runs()
    assert list(runs["run_id"]) == [source.ids[1]] and list(runs["name"]) == ["bob's run"]
    assert destination.layer_stats(source.ids[1]).empty  # bob's run got none of them


@pytest.mark.parametrize("status", ["running", "paused", "queued"])
def test_an_active_run_arrives_interrupted_and_says_so(source, tmp_path, status):
    run_id = source.ids[0]
    source.set_status(run_id, status)
    source.request(run_id, "stop")
    copies = copy_runs(source.path, tmp_path / "laptop.db", [run_id])
    assert (copies[0].status, copies[0].progress_step) == ("interrupted", 3)
    destination = RunStore(tmp_path / "laptop.db")
    info = destination.run_info(run_id)
    assert info["status"] == "interrupted"
    assert info["message"] == f"Copied while {status} at step 3: it does not train in this store."
    assert destination.pending_request(run_id) is None  # the source's Stop is not copied
    assert source.status(run_id) == status and source.pending_request(run_id) == "stop"
    assert destination.recover() == []


def test_a_read_only_source_is_copied_and_left_as_it_was(source, tmp_path):
    folder = source.path.parent
    source.close()
    before = digest(source.path)
    os.chmod(source.path, 0o444)
    os.chmod(folder, 0o555)
    try:
        copy_runs(source.path, tmp_path.parent / f"{tmp_path.name}-dest.db")
    finally:
        os.chmod(folder, 0o755)
        os.chmod(source.path, 0o644)
    assert digest(source.path) == before
    destination = RunStore(tmp_path.parent / f"{tmp_path.name}-dest.db")
    assert set(destination.runs()["run_id"]) == set(source.ids)


def _mode_ro_fails(monkeypatch):
    """SQLite as on a read-only disk: a WAL store cannot be opened with `mode=ro` (no -shm)."""
    opened = []
    real = transfer._connect

    def connect(path, parameter):
        opened.append(parameter)
        if parameter == "mode=ro" and "gradflow-import-" not in str(path):
            raise sqlite3.OperationalError("unable to open database file")
        return real(path, parameter)

    monkeypatch.setattr(transfer, "_connect", connect)
    return opened


def test_where_mode_ro_cannot_open_it_the_store_is_read_immutable(source, tmp_path, monkeypatch):
    source.close()
    opened = _mode_ro_fails(monkeypatch)
    conn, how, temporary = transfer.open_read_only(source.path)
    conn.close()
    assert (how, temporary, opened) == ("immutable", None, ["mode=ro", "immutable=1"])
    copy_runs(source.path, tmp_path / "class.db")
    assert_same_run(source, RunStore(tmp_path / "class.db"), source.ids[1])


def test_a_wal_that_immutable_would_miss_is_read_from_a_copy(tmp_path, monkeypatch):
    """A store left with rows only in its -wal (its writer still open, or killed)."""
    held = RunStore(tmp_path / "held.db")
    held.ids = [fill(held)]  # its writer checkpoints at its close; nothing after it does
    run_id = held.create_run({"depth": 3}, name="only in the wal", status="completed")
    wal = held.path.with_name("held.db-wal")
    # What a read-only disk holds: the file and its -wal, no -shm.
    disk = tmp_path / "disk"
    disk.mkdir()
    for path in (held.path, wal):
        shutil.copyfile(path, disk / path.name)
    before = [digest(disk / name) for name in ("held.db", "held.db-wal")]
    blind = sqlite3.connect(f"{(disk / 'held.db').as_uri()}?immutable=1", uri=True)
    assert blind.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)  # what it would miss
    blind.close()
    opened = _mode_ro_fails(monkeypatch)
    conn, how, temporary = transfer.open_read_only(disk / "held.db")
    conn.close()
    shutil.rmtree(temporary)
    assert how == "copy" and opened == ["mode=ro", "mode=ro"]
    copies = copy_runs(disk / "held.db", tmp_path / "class.db")
    assert [c.run_id for c in copies] == [*held.ids, run_id]
    for copied in (*held.ids, run_id):
        assert_same_run(held, RunStore(tmp_path / "class.db"), copied)
    assert [digest(disk / name) for name in ("held.db", "held.db-wal")] == before


def test_a_store_on_a_read_only_mount_is_copied(source, tmp_path):
    """The real thing where this machine lets us mount: SQLite's `mode=ro` fails there."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a folder read-only")
    source.close()
    mount = tmp_path / "mount"
    mount.mkdir()
    script = (
        "import sys; from gradflow.store import transfer; "
        "c, how, _ = transfer.open_read_only(sys.argv[1]); c.close(); print(how); "
        "print(len(transfer.copy_runs(sys.argv[1], sys.argv[2])))"
    )
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount --bind "$0" "$1" && mount -o remount,bind,ro "$1" && '
            '"$2" -c "$3" "$1/alice.db" "$4"',
            str(source.path.parent),
            str(mount),
            sys.executable,
            script,
            str(tmp_path.parent / f"{tmp_path.name}-mounted.db"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    if result.returncode != 0 and "mount" in result.stderr:
        pytest.skip(f"cannot mount here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["immutable", "2"]
    copied = RunStore(tmp_path.parent / f"{tmp_path.name}-mounted.db")
    assert_same_run(source, copied, source.ids[0])


def test_a_newer_store_is_refused_and_nothing_is_made(source, tmp_path):
    conn = sqlite3.connect(source.path)
    with conn:
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'schema_version'",
            (str(tables.SCHEMA_VERSION + 1),),
        )
    conn.close()
    target = tmp_path / "class.db"
    with pytest.raises(NewerStoreError, match="alice.db.*newer gradflow.*Upgrade gradflow"):
        copy_runs(source.path, target)
    assert not target.exists()


def test_an_older_store_is_upgraded_in_a_copy_and_left_as_it_was(tmp_path):
    old = tmp_path / "old.db"
    write_v1_store(old, V1_ROWS)
    before = digest(old)
    copy_runs(old, tmp_path / "class.db")
    assert digest(old) == before
    upgraded = tmp_path / "upgraded.db"
    shutil.copyfile(old, upgraded)
    assert_same_run(RunStore(upgraded), RunStore(tmp_path / "class.db"), "aaaaaaaaaaaa")


def test_not_a_store_a_folder_and_the_same_store_are_refused(source, tmp_path):
    junk = tmp_path / "notes.db"
    junk.write_bytes(b"not SQLite at all" * 10)
    with pytest.raises(ValueError, match="not a gradflow run store") as caught:
        copy_runs(junk, tmp_path / "class.db")
    assert "Give a new file name" not in str(caught.value)
    with pytest.raises(ValueError, match="got the folder"):
        copy_runs(tmp_path, tmp_path / "class.db")
    with pytest.raises(FileNotFoundError, match="missing.db"):
        copy_runs(tmp_path / "missing.db", tmp_path / "class.db")
    with pytest.raises(ValueError, match="is the store to copy into"):
        copy_runs(source.path, source.path)
    live = sqlite3.connect(tmp_path / "live.db")  # its table only in the -wal
    live.execute("PRAGMA journal_mode = WAL")
    live.execute("CREATE TABLE runs (x)")
    live.commit()
    shutil.copyfile(tmp_path / "live.db", tmp_path / "cp-of-live.db")  # as `cp` would, no -wal
    live.close()
    with pytest.raises(ValueError, match="copy made without its '-wal' file"):
        copy_runs(tmp_path / "cp-of-live.db", tmp_path / "class.db")
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ValueError, match="not a gradflow run store"):
        copy_runs(empty, tmp_path / "class.db")


def test_export_writes_one_file_that_imports_as_the_run(source, tmp_path):
    sent = tmp_path / "mail" / "relu.db"
    export_runs(source.path, sent, [source.ids[0]])
    assert sorted(p.name for p in sent.parent.iterdir()) == ["relu.db"]  # no -wal, no leftovers
    assert sent.read_bytes()[18:20] == b"\x01\x01"  # rollback journal: one file, readable anywhere
    with pytest.raises(FileExistsError, match="relu.db"):
        export_runs(source.path, sent, [source.ids[1]])
    assert [c.run_id for c in copy_runs(sent, tmp_path / "bob.db")] == [source.ids[0]]
    assert_same_run(source, RunStore(tmp_path / "bob.db"), source.ids[0])


# A stranger's store, made by hand from a good one: each edit is something
# gradflow never writes, and each broke the class store it was imported into
# (every page, a run nothing could delete, rows labelled wrong, a disk filled).
HOSTILE = {
    "tags that are not JSON": "UPDATE runs SET tags = 'not json'",
    "a run id gradflow does not make": "UPDATE runs SET run_id = '../x y' WHERE id = 1",
    "a status of its own": "UPDATE runs SET status = 'hacked<b>'",
    "a time that is text": "UPDATE runs SET created_at = 'yesterday'",
    "a pid that is a blob": "UPDATE runs SET pid = x'0102030405060708'",
    "a config nested deep": "UPDATE runs SET config = printf('%.50000c', '[')",
    "a config that is a list": "UPDATE runs SET config = '[1, 2]'",
    "a short statistics blob": "UPDATE layer_stats SET max_abs = x'00'",
    "steps past the block's last": "UPDATE layer_stats SET last_step = last_step - 1",
    "series the run does not have": "UPDATE series SET series = series + 1000",
    "a series id that sizes an array of 16 GiB": "UPDATE series SET series = 2147483647 "
    "WHERE series = 0",
    "a name that is not text": "UPDATE runs SET name = x'00ff' WHERE id = 1",
    "short histogram counts": "UPDATE histograms SET counts = x'00'",
    "histogram counts that are floats": lambda conn: conn.execute(
        "UPDATE histograms SET counts = ?", (np.ones(schema.HISTOGRAM_BINS).tobytes(),)
    ),
    "an event of a kind of its own": "UPDATE events SET kind = 'evil'",
    "a view for a table": "DROP TABLE metrics; CREATE VIEW metrics AS "
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
    "SELECT 1 AS run, i AS step, 'loss' AS name, 0.0 AS value FROM n",
    "a trigger": "CREATE TRIGGER t AFTER INSERT ON runs BEGIN DELETE FROM runs; END",
    "a table without its columns": "DROP TABLE events; CREATE TABLE events (id INTEGER)",
}


@pytest.mark.parametrize("edit", list(HOSTILE), ids=list(HOSTILE))
def test_a_store_holding_what_gradflow_never_writes_is_refused_whole(source, tmp_path, edit):
    source.close()
    conn = sqlite3.connect(source.path)
    if callable(HOSTILE[edit]):
        HOSTILE[edit](conn)
    else:
        conn.executescript(HOSTILE[edit])
    conn.commit()
    conn.close()
    destination = RunStore(tmp_path / "class.db")
    mine = fill(destination, "teacher")
    with pytest.raises(transfer.UntrustedStoreError, match="holds what gradflow does not write"):
        copy_runs(source.path, destination.path)
    assert destination.runs()["run_id"].tolist() == [mine]  # nothing copied, the store works


def test_the_command_line_refuses_a_strangers_store_in_one_line(source, tmp_path, capsys):
    from gradflow import cli

    source.close()
    with sqlite3.connect(source.path) as conn:
        conn.execute(HOSTILE["tags that are not JSON"])
    assert cli.main(["import", str(source.path), "--db", str(tmp_path / "class.db")]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "alice.db" in said[0] and "nothing was copied" in said[0], said


def test_a_blank_name_gradflow_took_is_named_not_refused(source, tmp_path):
    """`create_run(name=" ")` stores it, and the import refused the whole store for it."""
    blank = source.create_run({}, name=" ")
    destination = RunStore(tmp_path / "class.db")
    copy_runs(source.path, destination.path)
    assert destination.run_info(blank)["name"] == "(no name)"


def test_what_an_older_gradflow_or_a_long_failure_wrote_is_mended_not_refused(source, tmp_path):
    """A failure's whole traceback as the run's message, 120 tags or a tag of 250 characters
    (which the store takes), and names older gradflows let through (a tab, pasted
    right-to-left text, 300 characters) refused the whole store, and its export too."""
    source.close()
    first, second = source.ids
    traceback = "Traceback (most recent call last):\n" + "  File x\n" * 5000
    with sqlite3.connect(source.path) as conn:
        conn.execute("UPDATE runs SET message = ? WHERE run_id = ?", (traceback, first))
        conn.execute("UPDATE runs SET name = ? WHERE run_id = ?", ("a\tb \u202bשלום\u202c", first))
        conn.execute(
            "UPDATE runs SET name = ?, tags = ? WHERE run_id = ?",
            ("x" * 300, json.dumps([f"t{i}" for i in range(120)] + ["長" * 250]), second),
        )
    destination = RunStore(tmp_path / "class.db")
    copies = copy_runs(source.path, destination.path)
    assert [c.copied for c in copies] == [True, True]
    mended = destination.run_info(first)
    assert mended["name"] == "a\ufffdb \ufffdשלום\ufffd"
    assert len(mended["message"]) == source_checks.MAX_TEXT
    assert mended["message"].startswith("Traceback") and mended["message"].endswith("\u2026")
    other = destination.run_info(second)
    assert other["name"] == "x" * 199 + "\u2026" and len(other["tags"]) == 121
    pd.testing.assert_frame_equal(
        destination.layer_stats(first), RunStore(source.path).layer_stats(first)
    )


def test_a_label_tells_a_students_runs_of_one_name_apart(source, tmp_path, capsys):
    """Seven runs named "relu · depth 3 · width 8 · sgd lr=0.05" from seven students, and
    nothing in the pickers, the figures or the exports named whose each was."""
    from gradflow import cli

    class_db = tmp_path / "class.db"
    assert cli.main(["import", str(source.path), "--label", "Alice", "--db", str(class_db)]) == 0
    names = RunStore(class_db).runs().set_index("run_id")["name"]
    assert names[source.ids[0]] == "Alice: relu" and names[source.ids[1]] == "Alice: sigmoid"
    with pytest.raises(ValueError, match="`label` must not contain control characters"):
        copy_runs(source.path, tmp_path / "other.db", label="Bob\x1b[2J")
    # Imported again, a run not yet there but updated in the source: the note names the
    # store to delete it from and the command that brings it back.
    source.set_status(source.ids[0], "running")
    other = tmp_path / "second.db"
    copy_runs(source.path, other)
    with source.writer(source.ids[0]) as writer:
        writer.progress(9)
    source.set_status(source.ids[0], "completed")
    (again,) = [
        c for c in copy_runs(source.path, other, label="Ali ce") if c.run_id == source.ids[0]
    ]
    assert not again.copied
    assert f"delete it from {str(other)!r}" in again.note
    # The command as it must be typed: into that store (not the default one), with the label.
    command = f"gradflow import {source.path} {source.ids[0]} --label 'Ali ce' --db {other}"
    assert f"`{command} --restore-deleted`" in again.note
    # Its advice followed: deleted there, the command brings the source's.
    RunStore(other).delete(source.ids[0])
    assert cli.main(shlex.split(command + " --restore-deleted")[1:]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith(f"copied  {source.ids[0]}  Ali ce: relu  (completed, step 9)")
    assert RunStore(other).run_info(source.ids[0])["progress_step"] == 9
    with pytest.raises(ValueError, match="`label` must be at most 50 characters"):
        copy_runs(source.path, tmp_path / "third.db", label="L" * 51)


def test_runs_lists_the_newest_made_first_whatever_order_they_came_in(source, tmp_path, capsys):
    """After imports `--last 3` gave the runs imported last, not the newest."""
    from gradflow import cli

    class_db = tmp_path / "class.db"
    mine = RunStore(class_db).create_run({}, name="mine, made first")
    with sqlite3.connect(class_db) as conn:
        conn.execute("UPDATE runs SET created_at = 1.0 WHERE run_id = ?", (mine,))
    newest = RunStore(class_db).create_run({}, name="made last")
    copy_runs(source.path, class_db)  # made before `newest`, added after it
    assert cli.main(["runs", "--db", str(class_db), "--last", "1"]) == 0
    assert newest in capsys.readouterr().out
    assert cli.main(["runs", "--db", str(class_db)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert mine in lines[-1]
