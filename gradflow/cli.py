"""The `gradflow` command line: train, list runs, export figures or runs, import runs, serve.

```
gradflow train --depth 10 --activation sigmoid --steps 300 --db runs.db
gradflow train --preset dead_relu
gradflow runs --db runs.db
gradflow export 3f2a9c1b7e4d --format png --out slides/ --db runs.db
gradflow export 3f2a9c1b7e4d --format store --out relu-run.db    # a run to send
gradflow import alice.db --db class.db                             # runs brought in
gradflow serve --port 8501
```

The `train` flags are made from `RunConfig`'s fields (`--learning-rate` for
`learning_rate`), so they take the same values and give the same error
messages as the dashboard. A bad flag or an invalid config exits with code 2
and one line on stderr, never a traceback.
"""

import argparse
import errno
import math
import os
import pathlib
import re
import sqlite3
import sys
import tempfile
import threading
import time

from gradflow.checks import backend_problem
from gradflow.lab.config import RunConfig, field_table, rename_settings, run_name
from gradflow.lab.presets import PRESETS, get_preset
from gradflow.quick_exit import quick_exit
from gradflow.run_settings import run_settings
from gradflow.store import (
    NewerStoreError,
    StoreGoneError,
    StoreUpgradeError,
    default_path,
    trouble,
)
from gradflow.store.store import NotARunStoreError, check_name

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad command line: the message is printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage block and exits; we want one line and a
    # return code, so that `main()` can be called from tests and scripts.
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def run():
    """The `gradflow` program: `main()` on the command line's arguments, then the exit.

    The exit skips Python's teardown of TensorFlow (`gradflow.quick_exit`):
    after `gradflow train` printed its table, the shell prompt came back
    1.2 s later.
    """
    quick_exit(main())


def main(argv=None):
    """Run the `gradflow` command line.

    Example:

    ```python
    from gradflow.cli import main
    main(["train", "--steps", "20", "--db", "runs.db"])    # 0
    ```

    Args:
        argv: The arguments after the program name, default `sys.argv[1:]`.

    Returns:
        The exit code: 0 when done (a diverged or stopped run is still a
        finished run), 1 when a run failed or an export could not be made,
        2 for a bad command line or config, 130 when interrupted.
    """
    parser = _build_parser()
    args = None
    # gradflow's own commands (and `serve`'s dashboard, which inherits it) run Keras on
    # TensorFlow: a KERAS_BACKEND=jax exported for the user's scripts is not theirs.
    # Put back at the end, for `main()` called from Python.
    exported = os.environ.get("KERAS_BACKEND")
    try:
        args = parser.parse_args(argv)
        if getattr(args, "command", None) == "train" and "keras" in sys.modules:
            # Keras was imported already (`main()` called from Python): its
            # backend is chosen, in words naming what chose it.
            problem = backend_problem("gradflow train", command="gradflow train ...")
            if problem is not None:
                _say_error(f"gradflow: {problem}")
                return EXIT_FAILED
        os.environ["KERAS_BACKEND"] = "tensorflow"
        if not getattr(args, "command", None):
            raise UsageError(
                "gradflow: choose a command: train, runs, export, import or serve (see --help)"
            )
        if getattr(args, "db", None):
            _check_db(args.db)
        elif hasattr(args, "db") and os.environ.get("GRADFLOW_DB"):
            _check_db(os.environ["GRADFLOW_DB"], "$GRADFLOW_DB")
        return args.handler(args)
    except UsageError as error:
        _say_error(str(error))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say_error("gradflow: interrupted")
        return EXIT_INTERRUPTED
    except (NotARunStoreError, NewerStoreError) as error:
        # `--db` named a folder, a file that is not a run store, or one too new.
        _say_error(f"gradflow: {error}")
        return EXIT_USAGE
    except StoreUpgradeError as error:
        # An older store that could not take this gradflow's tables (a full disk, an
        # older gradflow holding its lock): the message says what to do.
        _say_error(f"gradflow: {error}")
        return EXIT_FAILED
    except (sqlite3.Error, StoreGoneError) as error:
        # A full disk, a lock held too long, a damaged file: not a bad
        # command line, and not "not a run store", as all of them were called.
        where = getattr(args, "db", None) or default_path()
        _say_error(f"gradflow: could not use the run store: {trouble.explain(error, where)}.")
        return EXIT_FAILED
    except BrokenPipeError:
        # `gradflow runs | head -3`: the reader has what it wanted.
        # Python's recipe: what is left in stdout's buffer goes nowhere at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:
        # A `--out` that is a file, a folder that cannot be made, a full disk.
        _say_error(f"gradflow: {error.strerror or error}: {error.filename or ''}".rstrip(": "))
        return EXIT_FAILED
    finally:
        if exported is None:
            os.environ.pop("KERAS_BACKEND", None)
        else:
            os.environ["KERAS_BACKEND"] = exported


def _check_db(path, argument="--db"):
    """A `--db` that is a folder or another kind of file, in the flag's name (RunStore's says `path`)."""
    from gradflow.store.store import check_store_path

    try:
        check_store_path(path, argument)
    except NotARunStoreError as error:
        raise UsageError(f"gradflow: {error}") from None


def _build_parser():
    parser = _Parser(
        prog="gradflow",
        description="See how gradients flow through a Keras network while it trains.",
    )
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)

    train = commands.add_parser(
        "train",
        help="train a lab network and record its gradient statistics",
        description="Train a lab network, recording per-layer gradient statistics in the run "
        "store. Flags mirror gradflow.RunConfig; unset flags keep their defaults (or the "
        "preset's values).",
    )
    train.add_argument("--preset", help=f"start from a lecture preset: {', '.join(PRESETS)}")
    _add_db_flag(train)
    train.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    fields = train.add_argument_group("run configuration (gradflow.RunConfig)")
    for name, default, meta in field_table():
        _add_field_flag(fields, name, default, meta)
    train.set_defaults(handler=_train)

    runs = commands.add_parser("runs", help="list the runs in the store")
    _add_db_flag(runs)
    runs.add_argument(
        "--status",
        action="append",
        metavar="STATUS",
        help="only runs with this status (again for several): "
        "queued, running, paused, completed, stopped, diverged, interrupted, failed",
    )
    runs.add_argument("--name", metavar="TEXT", help="only runs whose name contains TEXT")
    runs.add_argument(
        "--last", type=int, metavar="N", help="only the N newest runs (after the filters)"
    )
    runs.add_argument(
        "--compact",
        action="store_true",
        help="give the space of deleted runs back to the disk (rewrites the file once; "
        "for a store made before gradflow did this on every delete)",
    )
    runs.set_defaults(handler=_runs)

    from_export = commands.add_parser(
        "export",
        help="export a run's figures or data, or the run itself to send",
        description="Write a run's figures (png, svg, pdf, html), their data (csv), a lesson "
        "pack (zip), or the run itself as a one-run store file (store) that another "
        "gradflow brings in with `gradflow import FILE`.",
    )
    from_export.add_argument("run", help="the run id (see `gradflow runs`)")
    from_export.add_argument(
        "--format",
        required=True,
        dest="fmt",
        help="png, svg, pdf, html, csv, zip (a lesson pack) or store (the whole run, to import)",
    )
    from_export.add_argument(
        "--out",
        required=True,
        help="folder to write into; with --format store also a new FILE.db",
    )
    _add_db_flag(from_export)
    from_export.set_defaults(handler=_export)

    bring = commands.add_parser(
        "import",
        help="copy runs from another run store into this one",
        description="Copy whole runs (statistics, metrics, alerts, histograms) from another "
        "run store file, such as a classmate's store or one made by `gradflow export RUN "
        "--format store`, into the store of --db. SOURCE is only read (a read-only disk "
        "will do). Run ids are kept; a run the store has already is skipped, so importing "
        "the same file twice copies nothing twice, and so is a run deleted from the store "
        "(unless --restore-deleted). A run still training in SOURCE arrives as interrupted.",
    )
    bring.add_argument("source", metavar="SOURCE", help="the run store file to copy from")
    bring.add_argument(
        "runs",
        metavar="RUN_ID",
        nargs="*",
        help="the runs to copy (the ids its sender gave you), default all",
    )
    bring.add_argument(
        "--label",
        help="put LABEL before each copied run's name (`--label Alice` makes 'Alice: relu "
        "· depth 4 ...'), so that a class's runs of one name can be told apart",
    )
    bring.add_argument(
        "--restore-deleted",
        action="store_true",
        help="also copy the runs that were deleted from the store (name their RUN_IDs to "
        "bring back only those); without it they stay deleted",
    )
    _add_db_flag(bring, "run store to copy into (made if needed)")
    bring.set_defaults(handler=_import_runs)

    serve = commands.add_parser("serve", help="start the dashboard (streamlit run app.py)")
    serve.add_argument("--port", type=int, default=8501, help="port, default 8501")
    serve.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to listen on, default 127.0.0.1 (this machine only); "
        "0.0.0.0 serves a classroom network (put it behind an authenticating proxy, see SECURITY.md)",
    )
    serve.add_argument(
        "--base-url-path",
        default=None,
        metavar="PATH",
        help="serve under http://ADDRESS:PORT/PATH/ (Streamlit's server.baseUrlPath), for a "
        "reverse proxy that passes the path on; one that strips it needs nothing",
    )
    _add_db_flag(serve)
    serve.set_defaults(handler=_serve)
    return parser


def _add_db_flag(parser, what="run store file"):
    parser.add_argument("--db", help=f"{what}, default $GRADFLOW_DB or ./gradflow-data/runs.db")


def _add_field_flag(group, name, default, meta):
    flag = "--" + name.replace("_", "-")
    kind = meta["kind"]
    if kind == "bool":
        group.add_argument(
            flag,
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=f"{meta['help']} (default {'on' if default else 'off'})",
        )
        return
    if kind == "choice":
        metavar = "{" + ",".join(meta["choices"]) + "}"
    elif kind == "int":
        metavar = f"{meta['low']}..{meta['high']}"
    else:
        metavar = kind.upper()
    # Values stay strings here: RunConfig.from_query parses and checks them,
    # so the messages are the ones the dashboard shows.
    group.add_argument(
        flag,
        dest=name,
        metavar=metavar,
        default=argparse.SUPPRESS,
        help=f"{meta['help']} (default {default})",
    )


def _config_from(args):
    given = {}
    for name, _, _ in field_table():
        if hasattr(args, name):
            value = getattr(args, name)
            given[name] = ("true" if value else "false") if isinstance(value, bool) else value
    try:
        preset = get_preset(args.preset).config if args.preset else None
        config = RunConfig.from_query({**(preset.to_query() if preset else {}), **given})
        if config.name:
            # The store refuses it too, but only after TensorFlow's start, with a traceback.
            check_name(config.name)
    except ValueError as error:
        raise UsageError(f"gradflow train: {_as_flags(str(error))}") from None
    if (
        preset is not None
        and given.get("name") is None
        and config.replace(name=preset.name) != preset
    ):
        # A preset's title describes its own settings: "Deep sigmoid network" on
        # a relu run named that run's figures and CSV files wrongly.
        config = config.replace(name=None)
    for note in _unused_flags(given, config):
        print(f"gradflow train: note: {note}", file=sys.stderr)
    return config


def _as_flags(message):
    """A RunConfig error with each setting named by its flag: `--learning-rate`, not `learning_rate`."""

    def flag(field, value):
        return f"--{field.replace('_', '-')}" + (f" {value}" if value is not None else "")

    return rename_settings(message, flag)


def _unused_flags(given, config):
    """Flags given that this run will not use: they were accepted without a word."""
    if "clip_value" in given and config.clipping == "none":
        yield (
            "--clip-value has no effect without clipping; add --clipping value, norm or "
            "global_norm."
        )
    if "rnn_cell" in given and config.architecture != "rnn":
        yield f"--rnn-cell is for --architecture rnn; this run is {config.architecture}."
    if "init_stddev" in given and config.initializer != "random_normal":
        yield (
            f"--init-stddev is for --initializer random_normal; this run uses {config.initializer}."
        )
    if given.get("residual") == "false" and config.architecture == "residual_mlp":
        yield (
            "--no-residual leaves a residual_mlp's skip connections on; use --architecture mlp "
            "for none."
        )


def _train(args):
    config = _config_from(args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from gradflow.lab.worker import execute
    from gradflow.store import RunStore

    store = RunStore(args.db)
    try:
        run_id = store.create_run(
            config,
            name=run_name(config),
            source="cli",
            total_steps=None if config.epochs else config.steps,
        )
        print(
            f"gradflow: run {run_id} ({config.architecture}, {config.depth} x {config.width}, "
            f"{config.activation}, {config.optimizer} lr={config.learning_rate:g}) on "
            f"{config.dataset}; store {store.path}",
            file=sys.stderr,
        )
        _import_tensorflow_quietly()  # before the bar, which its log lines would break
        # Training stays in this (main) thread, as Keras wants; a second thread
        # only reads the store to draw the progress bar.
        follower = None if args.no_progress else _ProgressFollower(store.path, run_id, config)
        started = time.monotonic()
        status = "failed"  # unless `execute` returns
        try:
            status = execute(store, run_id)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if follower is not None:
                follower.finish(status)
        elapsed = time.monotonic() - started
        info = store.run_info(run_id)
        steps = info["progress_step"]
        print(
            f"gradflow: run {run_id} {status} after {steps} steps in {elapsed:.1f} s"
            + (f": {printable(info['message'])}" if info["message"] else "")
        )
        table = final_layer_table(store, run_id)
        if len(table):
            print(
                f"Gradients per layer at step {int(table.attrs['step'])} (all of a layer's "
                "weights together; the exported heatmaps show kernels):"
            )
            shown = table.assign(layer=table["layer"].map(printable))
            print(shown.to_string(index=False, float_format=lambda value: f"{value:.3g}"))
        export_command = f"gradflow export {run_id} --format html --out gradflow-export" + (
            f" --db {args.db}" if args.db else ""
        )
        _print_alerts(store, run_id, export_command)
        if len(table):  # a run that recorded nothing has nothing to export
            print(f"Export: {export_command}")
        return EXIT_FAILED if status == "failed" else EXIT_OK
    finally:
        # Closed here: left to the garbage collector, a connection closes at exit, and
        # Python 3.13 says `ResourceWarning: unclosed database` whenever warnings show.
        store.close()


# TensorFlow's start-up lines ("oneDNN custom operations are on", "Could not
# find cuda drivers") go through absl before absl is initialised, where
# TF_CPP_MIN_LOG_LEVEL does not reach them (abseil/abseil-cpp#1957).
_START_UP_NOISE = re.compile(r"^(I\d{4} |WARNING: All log messages before absl::InitializeLog)")


def _import_tensorflow_quietly():
    """Imports TensorFlow and Keras without their informational start-up lines.

    Whatever else the import writes to stderr (warnings, errors) is passed on.
    """
    if "keras" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            import keras  # noqa: F401  (imports TensorFlow, its backend)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _START_UP_NOISE.match(line)))


_ALERTS_SHOWN = 5


def _print_alerts(store, run_id, export_command):
    """The run's alerts, the most serious first: the dashboard's Alerts view in a terminal."""
    from gradflow.export import alerts_in_order

    alerts = alerts_in_order(store.events(run_id))
    if not len(alerts):
        return
    print(f"Alerts ({len(alerts)}):")
    for row in alerts.head(_ALERTS_SHOWN).itertuples():
        print(f"- {row.kind}: {printable(row.message)}")
    if len(alerts) > _ALERTS_SHOWN:
        print(
            f"- ... and {len(alerts) - _ALERTS_SHOWN} more; the export's data/alerts.csv "
            f"has them all ({export_command})."
        )


def final_layer_table(store, run_id):
    """Per-layer gradient `max_abs` and `l2_norm` at the last recorded step.

    Args:
        store: A `RunStore`.
        run_id: The run.

    Returns:
        A DataFrame with columns `layer_index, layer, max_abs, l2_norm,
        nonfinite`, one row per layer, 0 nearest the input; `max_abs` is the
        largest entry over the layer's weight gradients, `l2_norm` the L2 norm
        of all of them together (NaN if any is), `nonfinite` their count of
        NaN/Inf entries. `attrs["step"]` holds the step. Empty if nothing was
        recorded.
    """
    import numpy as np
    import pandas as pd

    from gradflow import schema

    info = store.run_info(run_id)
    config = info["config"]
    every = int(config.get("record_every", 1)) if isinstance(config, dict) else 1
    # Read only the tail of a long run: the last record is at most `every` back.
    after = max(0, int(info["progress_step"]) - every - 1)
    stats = store.layer_stats(run_id, after_step=after)
    if not len(stats):
        stats = store.layer_stats(run_id)
    stats = stats[stats["tensor"].map(schema.is_weight)]
    columns = ["layer_index", "layer", "max_abs", "l2_norm", "nonfinite"]
    if not len(stats):
        return pd.DataFrame(columns=columns)
    step = stats["step"].max()
    last = stats[stats["step"] == step]
    rows = []
    # NaN must show as NaN: pandas' default max/sum would skip it and hide
    # exactly the layer a user is looking for.
    for (index, layer), group in last.groupby(["layer_index", "layer"], observed=True, sort=True):
        rows.append(
            {
                "layer_index": index,
                "layer": layer,
                "max_abs": group["max_abs"].max(skipna=False),
                "l2_norm": float(np.sqrt((group["l2_norm"] ** 2).sum(skipna=False))),
                "nonfinite": int(group["nonfinite"].fillna(0).sum()),
            }
        )
    table = pd.DataFrame(rows, columns=columns)
    table.attrs["step"] = step
    return table


class _ProgressFollower:
    """A tqdm bar fed from the run store by a reader thread."""

    def __init__(self, store_path, run_id, config, interval=0.25):
        from tqdm import tqdm

        self._store_path = store_path
        self._run_id = run_id
        self._interval = interval
        self._done = threading.Event()
        total = None if config.epochs else config.steps
        self._bar = tqdm(total=total, unit="step", desc="training", dynamic_ncols=True)
        self._thread = threading.Thread(target=self._follow, name="gradflow-progress", daemon=True)
        self._thread.start()

    def _follow(self):
        from gradflow.store import RunStore

        reader = RunStore(self._store_path)
        loss_step = 0
        try:
            while True:
                finished = self._done.wait(self._interval)
                try:
                    info = reader.run_info(self._run_id)
                    step = int(info["progress_step"])
                    losses = reader.metrics(self._run_id, after_step=loss_step, names=["loss"])
                except Exception:  # A busy database must not end the training.
                    continue
                if self._bar.total is None and info["total_steps"] is not None:
                    # A run of epochs: the worker sets its length once the data is loaded.
                    self._bar.total = int(info["total_steps"])
                    self._bar.refresh()
                if len(losses):
                    last = losses.iloc[-1]
                    loss_step = int(last["step"])
                    value = float(last["value"])
                    self._bar.set_postfix(loss=f"{value:.4g}" if math.isfinite(value) else value)
                # Metrics can reach the store before the progress heartbeat.
                step = max(step, loss_step)
                if step > self._bar.n:
                    self._bar.update(step - self._bar.n)
                if finished:
                    return
        finally:
            reader.close()  # in this thread: its connection is this thread's

    def finish(self, status="completed"):
        self._done.set()
        self._thread.join(timeout=10)
        if status != "completed":
            # Left as "training 3/300" with a time to go, a diverged run looks stuck.
            self._bar.set_description(status)
        self._bar.close()


def _runs(args):
    from gradflow.store import RunStore
    from gradflow.store.tables import STATUSES

    wrong = [s for s in args.status or () if s not in STATUSES]
    if wrong:
        raise UsageError(
            f"gradflow runs: --status must be one of {', '.join(STATUSES)}, got {wrong[0]!r}"
        )
    if args.last is not None and args.last < 1:
        raise UsageError(f"gradflow runs: --last must be a positive number, got {args.last}")
    _named_store_exists(args.db, "runs")
    store = RunStore(args.db)
    try:
        if args.compact:
            before, after = store.compact()
            print(f"{store.path}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
        store.recover()  # a run whose `gradflow train` was killed is not "running"
        runs = store.runs(with_config=True)  # newest made first
        if not len(runs):
            print("No runs yet. Start one with: gradflow train")
            return EXIT_OK
        if args.status:
            runs = runs[runs["status"].isin(args.status)]
        if args.name:
            runs = runs[runs["name"].str.contains(args.name, case=False, regex=False)]
        if args.last is not None:
            runs = runs.head(args.last)  # newest first
        if not len(runs):
            print("No runs match.")
            return EXIT_OK
        table = runs[["run_id", "name", "status", "source", "progress_step", "total_steps"]].copy()
        table.insert(3, "created", runs["created_at"].dt.strftime("%Y-%m-%d %H:%M:%S"))
        settings = [run_settings(r.source, r.config, r.name) for r in runs.itertuples()]
        if any(settings):
            # KerasTuner's trials share their model's name; a renamed lab run lost its settings.
            table["settings"] = [printable(text) for text in settings]
        if runs["host"].nunique() > 1:
            # Runs brought in from several machines (`gradflow import`): whose is whose.
            # No host (a run of an older store) read "nan" under pandas 3: nothing instead.
            table["machine"] = [printable(h) if isinstance(h, str) else "" for h in runs["host"]]
        table = table.rename(columns={"progress_step": "step", "total_steps": "of"})
        # Names are anyone's: an ESC in one cleared the reader's screen or set its title.
        table["name"] = table["name"].map(printable)
        print(table.to_string(index=False))
        return EXIT_OK
    finally:
        store.close()


# C0 and C1 control characters, DEL, and the bidirectional overrides and isolates
# (U+202A-U+202E, U+2066-U+2069), which reorder the rest of a terminal's line.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text):
    r"""`text` as a terminal should show it: what would act on the terminal written out.

    ```python
    printable("slides\x1b]0;TITLE\x07")    # 'slides\\x1b]0;TITLE\\x07'
    ```

    A run name, a layer name or a message can come from anyone who can
    write to the store: its escape sequences would otherwise clear the
    reader's screen, set the window's title or recolour what follows.
    """
    return _UNPRINTABLE.sub(
        lambda match: match[0].encode("unicode_escape").decode("ascii"), str(text)
    )


def _named_store_exists(db, command, consequence=None):
    """Refuse a `--db` (or `$GRADFLOW_DB`) that names no file, for a command that only reads.

    `gradflow runs --db typo.db` made an empty store there and said "No runs
    yet", as if the runs were lost. (The default store, not made before the
    first run, is still "No runs yet".)
    """
    where = "--db"
    if db is None:
        db, where = os.environ.get("GRADFLOW_DB"), "$GRADFLOW_DB"
    if not db or pathlib.Path(db).exists():
        return
    said = f", {consequence}" if consequence else ""
    raise UsageError(
        f"gradflow {command}: no run store at {db!r} ({where}){said}. Check the path; "
        f"`gradflow train --db {db}` makes one."
    )


def _export(args):
    from gradflow.export import EXPORT_FORMATS, ExportError, export_run
    from gradflow.store import RunStore

    if args.fmt not in (*EXPORT_FORMATS, "store"):
        raise UsageError(
            f"gradflow export: --format must be one of {', '.join(EXPORT_FORMATS)} or store, "
            f"got {args.fmt!r}"
        )
    _named_store_exists(args.db, "export", f"so no run {args.run!r} to export")
    if args.fmt == "store":
        return _export_store(args)
    store = RunStore(args.db)
    try:
        paths = export_run(store, args.run, args.fmt, args.out)
    except ExportError as error:
        _say_error(f"gradflow export: {error}")
        return EXIT_FAILED
    except ValueError as error:  # An unknown or malformed run id.
        raise UsageError(f"gradflow export: {error}") from None
    finally:
        store.close()
    for path in paths:
        print(path)
    return EXIT_OK


def _export_store(args):
    """`gradflow export RUN --format store`: the run in a new one-run store file."""
    from gradflow.export import file_stem
    from gradflow.store import RunStore
    from gradflow.store.transfer import SourceStoreError, export_runs

    store = RunStore(args.db)  # made if new: then the run is unknown, said below
    source = store.path
    out = pathlib.Path(args.out)
    try:
        if out.suffix.lower() in _STORE_SUFFIXES and not out.is_dir():
            target = out
        else:
            try:
                name = store.run_info(args.run)["name"]
            except ValueError as error:  # An unknown or malformed run id.
                raise UsageError(f"gradflow export: {error}") from None
            target = out / f"{file_stem(args.run, name or 'run')}.db"
    finally:
        store.close()
    try:
        export_runs(source, target, [args.run])
    except FileExistsError as error:
        _say_error(f"gradflow export: {error}")
        return EXIT_FAILED
    except SourceStoreError as error:  # a damaged store, in words, not a traceback
        _say_error(f"gradflow export: {error}")
        return EXIT_FAILED
    except ValueError as error:
        raise UsageError(f"gradflow export: {error}") from None
    except sqlite3.Error as error:
        # The new file's trouble (a folder it cannot write): the store read is not to blame.
        _say_error(
            f"gradflow export: could not write the new store {str(target)!r} ({error}): check "
            "that its folder exists, can be written and has room, or give another --out."
        )
        return EXIT_FAILED
    print(target)
    return EXIT_OK


# An `--out` with one of these names the store file itself, not a folder.
_STORE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def _import_runs(args):
    """`gradflow import SOURCE [RUN_ID ...]`: copy runs into the store of --db."""
    from gradflow.store.transfer import SourceStoreError, copy_runs

    source = pathlib.Path(args.source)
    if not source.exists():
        raise UsageError(f"gradflow import: no run store at {args.source!r}: check the path")
    destination = args.db or os.environ.get("GRADFLOW_DB") or default_path()
    try:
        copies = copy_runs(
            source,
            destination,
            args.runs or None,
            label=args.label,
            restore_deleted=args.restore_deleted,
        )
    except NotARunStoreError as error:
        raise UsageError(f"gradflow import: {error}") from None
    except SourceStoreError as error:
        _say_error(f"gradflow import: {error}")
        return EXIT_FAILED
    except (ValueError, FileNotFoundError) as error:
        # An unknown or malformed run id, a run id taken by another run, one store twice.
        raise UsageError(f"gradflow import: {error}") from None
    if copies.deletions:
        # A whole store moved into a new one: say why its deleted runs will stay out.
        print(
            f"gradflow: {copies.deletions} deletion{'s' * (copies.deletions != 1)} of "
            f"{args.source} carried into {destination}: runs deleted there stay out of later "
            "imports (--restore-deleted brings one back)",
            file=sys.stderr,
        )
    if not copies:
        print(f"No runs in {args.source}.")
        return EXIT_OK
    for copy in copies:
        said = f" {copy.note}" if copy.note else ""
        print(
            f"{'copied ' if copy.copied else 'skipped'} {copy.run_id}  {printable(copy.name)}  "
            f"({copy.status}, step {copy.progress_step}){printable(said)}"
        )
    copied = sum(copy.copied for copy in copies)
    deleted = sum(copy.deleted_at is not None for copy in copies)
    already = len(copies) - copied - deleted
    print(
        f"gradflow: {copied} run{'s' * (copied != 1)} copied into {destination}"
        + (f", {already} already there" if already else "")
        + (
            f", {deleted} deleted there (--restore-deleted brings "
            f"{'them' if deleted > 1 else 'it'} back)"
            if deleted
            else ""
        ),
        file=sys.stderr,
    )
    return EXIT_OK


def dashboard_app():
    """The path of the dashboard's `app.py`: beside the package, else in the working folder.

    Raises:
        FileNotFoundError: If neither has one.
    """
    candidates = [
        pathlib.Path(__file__).resolve().parent.parent / "app.py",
        pathlib.Path.cwd() / "app.py",
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "Cannot find the dashboard's app.py (looked in "
        + " and ".join(str(c.parent) for c in candidates)
        + "); run `gradflow serve` from the gradflow folder."
    )


def _port_taken(address, port):
    """Whether a server already listens on `address:port` (a bind there fails)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((address, port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def _serve(args):
    try:
        app = dashboard_app()
    except FileNotFoundError as error:
        _say_error(f"gradflow serve: {error}")
        return EXIT_FAILED
    if _port_taken(args.address, args.port):
        # Else it printed "dashboard at http://...:8614", the other server's
        # address (another store), and then failed.
        _say_error(
            f"gradflow serve: port {args.port} on {args.address} is in use (another "
            "dashboard?): choose another with --port."
        )
        return EXIT_FAILED
    environment = dict(os.environ)
    if args.db:
        environment["GRADFLOW_DB"] = str(pathlib.Path(args.db).resolve())
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.port",
        str(args.port),
        "--server.address",
        args.address,
        "--server.headless",
        "true",
    ]
    base = args.base_url_path
    if base is not None:
        command += ["--server.baseUrlPath", base.strip("/")]
    else:  # Streamlit reads it from the environment too
        base = environment.get("STREAMLIT_SERVER_BASE_URL_PATH", "")
    where = f"http://{args.address}:{args.port}" + (
        f"/{base.strip('/')}/" if base.strip("/") else ""
    )
    print(f"gradflow: dashboard at {where} ({' '.join(command)})")
    sys.stdout.flush()
    # Pages are found relative to app.py, so streamlit runs from its folder.
    os.chdir(app.parent)
    # This process becomes the server: a SIGTERM to `gradflow serve` (a
    # service manager, `kill`) stopped only a parent and left the dashboard
    # serving the port.
    os.execve(sys.executable, command, environment)


def _say_error(message):
    print(message.splitlines()[0] if message else "gradflow: error", file=sys.stderr)
