"""`load_arrays`: read uploaded `.npz`, `.npy` and `.csv` data without trusting it.

`numpy.load` decompresses whatever a zip member declares and, with
`allow_pickle=True`, runs pickles; `pandas.read_csv` reads as many rows as the
file has. Here every `.npy` header (dtype and shape) is read and checked
*before* any array data is read, compressed sizes are checked against the zip
directory before anything is decompressed, and CSV reading stops at a row cap.
A CSV's rows are counted with Python's `csv` module before pandas parses it:
pandas spends time and memory out of proportion on a row wider than the
header, and silently turns its extra values into an index.

Only real numbers are accepted: bool, integer, unsigned and float dtypes.
Complex, object, string, void, structured and datetime arrays are refused,
and so are arrays with an axis of length 0.
"""

import csv
import math
import os
import re

import numpy as np

from gradflow.checks import positive_int
from gradflow.safety import archives
from gradflow.safety.errors import UnsafeInputError

NPY_MAGIC = b"\x93NUMPY"
_MAX_MEMBERS = 64
_MAX_HEADER_BYTES = 10_000
_NUMERIC_KINDS = "biuf"
# What `np.savez(path, x=...)` writes: one name and `.npy`. A model's input
# may be named `img-in` or `meta.v2` (Keras allows both, and an .npz names its
# arrays after the inputs, via `np.savez(path, **{"img-in": ...})`), so `-` and
# `.` are allowed inside a name. Anything else (`./x.npy`, `sub/x.npy`,
# `x.npy.npy`) would come back as a second, differently spelled `x` or as a
# name no code looks for.
_NPZ_MEMBER = re.compile(r"(?!.*\.\.)(?!.*\.npy\.npy$)[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}\.npy")
# Most columns of a .csv file. Far more features than a table a student
# uploads has, and it bounds what one row can cost before pandas sees it
# (pandas spends about 2 KiB per value of a row wider than the header).
_MAX_CSV_COLUMNS = 10_000
_LABEL_NAMES = ("y", "label", "target")
_SUFFIXES = (".npz", ".npy", ".csv")


def load_arrays(path, *, max_bytes=50 * 2**20, max_rows=1_000_000, max_elements=20_000_000):
    """Reads numeric arrays from an uploaded `.npz`, `.npy` or `.csv` file.

    Example:

    ```python
    data = gradflow.load_arrays("upload.csv")
    x, y = data["x"], data["y"]
    ```

    - `.npz`: one entry per array, named as in `np.savez(path, x=..., y=...)`
      (letters, digits and underscores). Read with pickles disabled; every
      header is checked before its data.
    - `.npy`: one array, returned as `{"x": array}`.
    - `.csv`: a table of numbers with a header row (a header made only of
      numbers is taken as data). Returns `{"x": float32 features, "y": labels}`
      where the label column is the one named `y`, `label` or `target`
      (any case), else the last column. Integer-valued labels come back as
      int64, others as float32. Every row must have as many values as the
      first, at most 10,000.

    Args:
        path: the uploaded file; its suffix (`.npz`, `.npy`, `.csv`) says how
            to read it, and its first bytes must match.
        max_bytes: largest file size. Defaults to 50 MiB.
        max_rows: most rows (first dimension) of any array or CSV. Defaults to
            1,000,000.
        max_elements: most values in all arrays together; it also caps the
            uncompressed size of a `.npz` at 8 bytes per value. Defaults to
            20,000,000.

    Returns:
        A dict from names to NumPy arrays in native byte order.

    Raises:
        UnsafeInputError: the file was refused; the message says why.
        ValueError: a limit argument is not a positive integer.
    """
    max_bytes = positive_int("max_bytes", max_bytes)
    max_rows = positive_int("max_rows", max_rows)
    max_elements = positive_int("max_elements", max_elements)
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in _SUFFIXES:
        raise UnsafeInputError(
            f"Cannot read {os.fspath(path)!r}: the file type {suffix or '(none)'!r} is not "
            f"accepted. Upload one of {', '.join(_SUFFIXES)}."
        )
    archives.check_file_size(path, max_bytes, "data file")
    limits = _Limits(max_rows, max_elements)
    if suffix == ".npz":
        return _load_npz(path, max_bytes, limits)
    if suffix == ".npy":
        with open(path, "rb") as f:
            return {"x": _read_npy(f, os.path.getsize(path), "The .npy file", limits)}
    return _load_csv(path, limits)


class _Limits:
    """Row and value budgets shared by all arrays of one file."""

    def __init__(self, max_rows, max_elements):
        self.max_rows = max_rows
        self.max_elements = max_elements
        self.elements = 0

    def take(self, shape, where):
        if shape and shape[0] > self.max_rows:
            raise UnsafeInputError(
                f"{where} has {shape[0]:,} rows, over the limit of `max_rows`={self.max_rows:,}."
            )
        self.elements += math.prod(shape)
        if self.elements > self.max_elements:
            raise UnsafeInputError(
                f"{where} (shape {shape}) brings the data to {self.elements:,} values, over "
                f"the limit of `max_elements`={self.max_elements:,}; nothing was read."
            )


def _load_npz(path, max_bytes, limits):
    if archives.read_head(path, 4) not in (archives.ZIP_MAGIC, archives.EMPTY_ZIP_MAGIC):
        raise UnsafeInputError("The .npz file is not a zip archive (as np.savez writes).")
    with archives.open_checked_zip(
        path,
        what="data file",
        max_bytes=max_bytes,
        max_entries=_MAX_MEMBERS,
        max_total_bytes=8 * limits.max_elements + _MAX_MEMBERS * _MAX_HEADER_BYTES,
        max_ratio=1000,
    ) as archive:
        arrays = {}
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise UnsafeInputError(
                    f"The .npz entry {info.filename!r} is not a .npy array; save with np.savez."
                )
            if not _NPZ_MEMBER.fullmatch(info.filename):
                raise UnsafeInputError(
                    f"The .npz entry {info.filename!r:.120} is not a plain array name. gradflow "
                    "reads entries named like 'x.npy' or 'img-in.npy': letters, digits, '_', "
                    "'-' and '.' (not first, not '..'), then '.npy', and no folders. Save the "
                    "arrays again with np.savez(path, x=..., y=...), or for a model of several "
                    "inputs np.savez(path, y=..., **{input_name: array})."
                )
            where = f"Array {info.filename[:-4]!r}"
            try:
                with archive.open(info, "r") as f:
                    arrays[info.filename[:-4]] = _read_npy(f, info.file_size, where, limits)
            except archives.CORRUPT_ZIP_ERRORS as e:
                raise UnsafeInputError(f"{where} in the .npz file is corrupt: {e}.") from e
    return arrays


def _read_npy(f, size, where, limits):
    """Reads one `.npy` stream of `size` bytes, checking its header first."""
    if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
        raise UnsafeInputError(f"{where} is not a NumPy .npy array.")
    version = tuple(f.read(2))
    try:
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(
                f, max_header_size=_MAX_HEADER_BYTES
            )
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(
                f, max_header_size=_MAX_HEADER_BYTES
            )
        else:
            raise UnsafeInputError(
                f"{where} has .npy format version {version}; 1.0 and 2.0 are read."
            )
    except UnsafeInputError:
        raise
    except Exception as e:  # noqa: BLE001 -- numpy's header parser raises many kinds (TokenError, ...)
        raise UnsafeInputError(f"{where} has an invalid .npy header: {e}") from e
    if dtype.kind == "c":
        raise UnsafeInputError(
            f"{where} has dtype {dtype}: complex numbers are not accepted. Gradients of "
            "them, and the statistics gradflow shows, are defined for real numbers only. "
            "Save the real and imaginary parts as two real features instead, e.g. "
            "np.stack([x.real, x.imag], axis=-1)."
        )
    if dtype.hasobject or dtype.kind not in _NUMERIC_KINDS or dtype.fields or dtype.subdtype:
        raise UnsafeInputError(
            f"{where} has dtype {dtype!s:.60}; only numeric arrays (bool, int, float) "
            "are accepted. Object arrays would need pickle, which can run code."
        )
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise UnsafeInputError(f"{where} declares an invalid shape {shape!r:.80}.")
    if shape and shape[0] == 0:
        # Refused later anyway ("the data are empty"), but only after the other
        # arrays were read; a declared (0, 10**12) also reads as 0 values here.
        raise UnsafeInputError(
            f"{where} has no examples: its shape is {shape}. Save at least one example "
            "(row) in each array."
        )
    if 0 in shape:
        raise UnsafeInputError(
            f"{where} holds no values: its shape {shape} has an axis of length 0. Every "
            "example needs at least one value."
        )
    limits.take(shape, where)
    nbytes = math.prod(shape) * dtype.itemsize
    header_bytes = f.tell()
    if header_bytes + nbytes != size:
        raise UnsafeInputError(
            f"{where} declares shape {shape} of {dtype} ({nbytes:,} bytes) but holds "
            f"{size - header_bytes:,} bytes of data; the file is truncated or padded."
        )
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise UnsafeInputError(f"{where} is truncated.")
    array = np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")
    return array.astype(dtype.newbyteorder("="), order="C", copy=True)


def _load_csv(path, limits):
    with open(path, "rb") as f:
        if b"\x00" in f.read(8192):
            raise UnsafeInputError("The .csv file contains binary data; upload a text CSV.")
    # The header and one row over `max_rows`: as many rows as pandas reads below.
    _check_csv_widths(path, limits.max_rows + 2)

    import pandas as pd

    def read(header):
        try:
            return pd.read_csv(
                path,
                header=header,
                nrows=limits.max_rows + 1,
                encoding="utf-8",
                encoding_errors="strict",
                engine="c",
                index_col=False,  # never turn leading values into an index
            )
        except Exception as e:  # noqa: BLE001 -- any parser failure on untrusted text is a refusal
            raise UnsafeInputError(f"The .csv file could not be read as CSV: {e}".strip()) from e

    table = read("infer")
    if len(table.columns) and all(_is_number(c) for c in table.columns):
        table = read(None)  # the first row was data, not a header
    if len(table) > limits.max_rows:
        raise UnsafeInputError(
            f"The .csv file has more than `max_rows`={limits.max_rows:,} rows; upload fewer "
            "rows or raise `max_rows`."
        )
    if table.shape[1] < 2 or len(table) == 0:
        raise UnsafeInputError(
            f"The .csv file has {len(table)} rows and {table.shape[1]} columns; at least one "
            "row and two columns (features and a label) are needed."
        )
    limits.take(table.shape, "The .csv file")
    for i, column in enumerate(table.columns):
        values = table.iloc[:, i]
        if not pd.api.types.is_numeric_dtype(values):
            bad = values[pd.to_numeric(values, errors="coerce").isna()]
            example = bad.iloc[0] if len(bad) else values.iloc[0]
            raise UnsafeInputError(
                f"Column {str(column)!r:.60} of the .csv file is not numeric (e.g. "
                f"{str(example)!r:.40}); only numbers are accepted."
            )
        finite = np.isfinite(values.to_numpy(dtype=np.float64))
        if not finite.all():
            raise UnsafeInputError(
                f"Column {str(column)!r:.60} of the .csv file has a missing or infinite value "
                f"in data row {int(finite.argmin()) + 1}; fill or drop it first."
            )
    names = [str(c).strip().lower() for c in table.columns]
    label_at = next((names.index(n) for n in _LABEL_NAMES if n in names), len(names) - 1)
    label = table.iloc[:, label_at].to_numpy(dtype=np.float64)
    feature_columns = [i for i in range(table.shape[1]) if i != label_at]
    features = table.iloc[:, feature_columns].to_numpy(dtype=np.float32)
    if np.array_equal(label, np.round(label)):
        label = label.astype(np.int64)
    else:
        label = label.astype(np.float32)
    return {"x": features, "y": label}


def _check_csv_widths(path, max_rows):
    """Refuses a CSV whose rows do not all have as many values as the first.

    Counted with Python's `csv` module, which splits quoted fields as pandas
    does, on at most `max_rows` rows (pandas reads no more). A row is split
    only once the commas of its lines showed it has at most
    `_MAX_CSV_COLUMNS` values, so no row costs more than that many strings.
    """
    with open(path, encoding="utf-8", errors="strict", newline="") as f:
        lines = _CommaCountedLines(f)
        reader = csv.reader(lines)
        first = None
        rows = 0
        try:
            for row in reader:
                lines.row_done()
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue  # a blank line, which pandas skips too
                rows += 1
                if first is None:
                    first = len(row)
                elif len(row) != first:
                    raise UnsafeInputError(
                        f"Line {reader.line_num} of the .csv file has {len(row):,} values, but "
                        f"the first row (line {lines.first_line}) has {first:,}. Every row "
                        "needs one value per column: look for a missing value or a stray "
                        "comma in that row."
                    )
                if rows >= max_rows:
                    return
        except _TooManyColumns as e:
            first_row = (
                "" if first is None else f"; the first row (line {lines.first_line}) has {first:,}"
            )
            raise UnsafeInputError(
                f"Line {e.line} of the .csv file has {e.count}{first_row}. gradflow reads at "
                f"most {_MAX_CSV_COLUMNS:,} columns from a .csv file: upload fewer columns, or "
                "save wide data as an .npz file with np.savez(path, x=..., y=...)."
            ) from None
        except UnicodeDecodeError as e:
            raise UnsafeInputError(
                f"The .csv file is not UTF-8 text ({e.reason}); save it as 'CSV UTF-8' and "
                "upload it again."
            ) from e
        except csv.Error as e:
            raise UnsafeInputError(
                f"The .csv file could not be read as CSV: line {reader.line_num}: {e}."
            ) from e


class _TooManyColumns(Exception):
    """A row over `_MAX_CSV_COLUMNS`, found by `_CommaCountedLines`; worded by the caller."""

    def __init__(self, line, count):
        super().__init__(line, count)
        self.line = line
        self.count = count


class _CommaCountedLines:
    """The lines of a text file for `csv.reader`, counting the commas of each row.

    `csv.reader` asks for another line only while the row it is splitting goes
    on, and `row_done` is called after each row it returns. A row whose lines
    hold `_MAX_CSV_COLUMNS` commas or more (that many values and one more,
    unless some commas are inside quotes) is refused before the reader makes a
    string of each of its values.
    """

    def __init__(self, file):
        self.file = file
        self.line = 0
        self.first_line = None
        self.commas = 0
        self.quoted = False

    def __iter__(self):
        return self

    def __next__(self):
        text = next(self.file)
        self.line += 1
        if self.first_line is None and text.strip():
            self.first_line = self.line
        self.commas += text.count(",")
        self.quoted = self.quoted or '"' in text
        if self.commas >= _MAX_CSV_COLUMNS:
            # Exact unless quotes may hide commas; the rest of a row that
            # quotes carry over several lines is not read.
            if self.quoted:
                raise _TooManyColumns(self.line, f"{_MAX_CSV_COLUMNS:,} commas or more")
            raise _TooManyColumns(self.line, f"{self.commas + 1:,} values")
        return text

    def row_done(self):
        self.commas = 0
        self.quoted = False


def _is_number(text):
    try:
        float(str(text))
    except ValueError:
        return False
    return True
