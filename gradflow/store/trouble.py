"""What went wrong with a run store, in words for whoever has to mend it.

SQLite says "database or disk is full", "database is locked" or "unable to
open database file", and names neither the file nor what to do. The monitor,
the command line and the dashboard all say it the same way, through `explain`.

Example:

```python
import sqlite3
from gradflow.store.trouble import explain
explain(sqlite3.OperationalError("database or disk is full"), "runs.db")
# "the disk that holds 'runs.db' is full: free some space there"
```
"""

import os
import pathlib
import shlex
import sqlite3

from gradflow.store.tables import StoreGoneError


class NewerStoreError(RuntimeError):
    """The store was written by a newer gradflow, whose schema this one cannot read."""


class StoreUpgradeError(RuntimeError):
    """A store of an older gradflow could not be brought to this one's schema (left unchanged)."""


class NotARunStoreError(sqlite3.DatabaseError, ValueError):
    """A path given as a run store is a folder or a file of another kind."""


class CopyWithoutLogError(NotARunStoreError):
    """A file with bytes but no tables: a store copied without its '-wal' file."""


# SQLite's result codes (Python 3.11's `sqlite_errorname`), else its words.
_CAUSES = (
    (("SQLITE_FULL",), ("disk is full",), "full"),
    (("SQLITE_BUSY", "SQLITE_LOCKED"), ("database is locked", "table is locked"), "locked"),
    (("SQLITE_READONLY",), ("readonly database",), "read-only"),
    (("SQLITE_CANTOPEN",), ("unable to open database file",), "cannot-open"),
    (("SQLITE_CORRUPT", "SQLITE_NOTADB"), ("malformed", "not a database"), "damaged"),
    (("SQLITE_IOERR",), ("disk i/o error",), "io"),
)


def cause(error):
    """The kind of trouble: "full", "locked", "read-only", "cannot-open", "damaged", "io" or None."""
    code = getattr(error, "sqlite_errorname", "") or ""
    text = str(error).lower()
    for codes, words, kind in _CAUSES:
        if any(code.startswith(c) for c in codes) or any(w in text for w in words):
            return kind
    return None


def explain(error, path):
    """One clause on what `error` means for the run store at `path`, and what to do.

    Args:
        error: the exception a store operation raised.
        path: the store's file.

    Returns:
        A sentence without a full stop, to follow "could not write to ... :".
        Errors gradflow words itself (a store gone or too new, not a store) keep their words.
    """
    if isinstance(error, (StoreGoneError, NewerStoreError, NotARunStoreError)):
        text = str(error).rstrip(".")
        return text[0].lower() + text[1:] if text.startswith("The ") else text
    path = pathlib.Path(path)
    where = repr(str(path))
    folder = repr(str(path.parent if str(path.parent) else pathlib.Path(".")))
    kind = cause(error)
    if kind == "full":
        return f"the disk that holds {where} is full: free some space there"
    if kind == "locked":
        return (
            f"another program holds the lock of {where} (a database browser left in a "
            "transaction, or `gradflow runs --compact` on a large store): close it, or "
            "wait for it to finish, and try again"
        )
    if kind in ("read-only", "cannot-open"):
        if path.exists() and not os.access(path.parent or ".", os.W_OK):
            return (
                f"the folder {folder} cannot be written, and SQLite needs to make its "
                f"'-wal' and '-shm' files beside {where} even to read it: bring its runs "
                f"into a store of yours with `gradflow import {shlex.quote(str(path))}` (it "
                "only reads the file), or give another store path (--db or $GRADFLOW_DB)"
            )
        if kind == "read-only":
            return (
                f"{where} can only be read here (a read-only file or disk): give a store "
                "this program can write (--db or $GRADFLOW_DB)"
            )
        return (
            f"{where} cannot be opened ({error}): check that its folder exists and can be "
            "written, or give another store path (--db or $GRADFLOW_DB)"
        )
    if kind == "damaged":
        # `.recover` prints SQL for what it can read; on a store cut in half
        # it saved nothing here, so it is offered as a try, not a cure.
        saved = shlex.quote(str(path.with_name(path.stem + "-recovered" + path.suffix)))
        return (
            f"{where} is damaged ({error}): keep a copy of it and start a new store (--db or "
            f"$GRADFLOW_DB); `sqlite3 {shlex.quote(str(path))} .recover | sqlite3 {saved}` "
            "may save part of it into a new file"
        )
    if kind == "io":
        return (
            f"a disk error while using {where} ({error}): the disk may be failing or full, "
            "or another program removed or replaced the store's '-wal' file while it was open"
        )
    return f"the run store {where} failed: {error}"
