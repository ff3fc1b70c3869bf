"""gradflow.load_arrays: real uploads round-trip, hostile ones are refused cheaply.

Every attack file is built here, in tmp_path. Refusals must be UnsafeInputError
(a ValueError) with a message that says what was wrong, must not run any
pickle (canary files stay absent) and must not decompress or allocate the
declared data (tracemalloc peak stays small).
"""

import io
import os
import pathlib
import tempfile
import tracemalloc
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradflow import UnsafeInputError, load_arrays

MiB = 2**20


def peak_bytes_of(fn):
    """Runs fn(); returns (its exception or None, peak traced allocation)."""
    tracemalloc.start()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 -- the caller asserts on it
        error = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, peak


class WritesCanary:
    """Unpickling this creates the file at `path` (as a real exploit would run code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# ---------------------------------------------------------------- happy paths


def test_npz_round_trip_keeps_names_dtypes_and_values(tmp_path):
    x = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    y = np.arange(7, dtype=">i4")  # big-endian comes back in native order
    mask = np.array([True, False, True])
    np.savez(tmp_path / "d.npz", x=x, y=y, mask=mask)
    np.savez_compressed(tmp_path / "c.npz", x=x)

    data = load_arrays(tmp_path / "d.npz")

    assert sorted(data) == ["mask", "x", "y"]
    np.testing.assert_array_equal(data["x"], x)
    np.testing.assert_array_equal(data["y"], y)
    assert data["y"].dtype == np.int32 and data["y"].dtype.isnative
    np.testing.assert_array_equal(data["mask"], mask)
    np.testing.assert_array_equal(load_arrays(tmp_path / "c.npz")["x"], x)


def test_npy_round_trip_including_fortran_order(tmp_path):
    a = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    np.save(tmp_path / "a.npy", a)
    out = load_arrays(tmp_path / "a.npy")
    assert list(out) == ["x"]
    np.testing.assert_array_equal(out["x"], a)


@pytest.mark.parametrize(
    "text, x, y, y_dtype",
    [
        # Label column named `target` in the middle; integer labels stay integers.
        ("a,target,b\n1,0,2\n3,1,4.5\n", [[1, 2], [3, 4.5]], [0, 1], np.int64),
        # No label name: the last column; real-valued labels become float32.
        ("f1,f2,out\n1,2,0.5\n3,4,1.5\n", [[1, 2], [3, 4]], [0.5, 1.5], np.float32),
        # Header-less file: the first row is data.
        ("1,2,0\n3,4,1\n", [[1, 2], [3, 4]], [0, 1], np.int64),
        # `Label` in any case.
        ("Label,a\n2,7\n1,8\n", [[7], [8]], [2, 1], np.int64),
    ],
)
def test_csv_round_trip(tmp_path, text, x, y, y_dtype):
    (tmp_path / "d.csv").write_text(text)
    data = load_arrays(tmp_path / "d.csv")
    assert data["x"].dtype == np.float32
    np.testing.assert_allclose(data["x"], np.array(x, dtype=np.float32))
    np.testing.assert_allclose(data["y"], y)
    assert data["y"].dtype == y_dtype


# ---------------------------------------------------------------- refusals


def write_npz_bomb(path, values, compression=zipfile.ZIP_DEFLATED):
    """A .npz whose single member holds `values` float64 zeros, deflated to ~0.1%."""
    with zipfile.ZipFile(path, "w", compression) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<f8", "fortran_order": False, "shape": (values,)}
            )
            chunk = bytes(8 * MiB)
            for _ in range(values * 8 // len(chunk)):
                f.write(chunk)


def test_npz_zip_bomb_is_refused_without_decompressing(tmp_path):
    path = tmp_path / "bomb.npz"
    write_npz_bomb(path, values=64 * MiB // 8 * 8)  # 512 MiB of zeros
    assert os.path.getsize(path) < 2 * MiB

    error, peak = peak_bytes_of(lambda: load_arrays(path))

    assert isinstance(error, UnsafeInputError), error
    assert "zip bomb" in str(error) and "'x.npy'" in str(error)
    assert peak < 8 * MiB


def test_npz_too_large_when_uncompressed_is_refused_by_the_value_cap(tmp_path):
    path = tmp_path / "big.npz"
    # Stored, not compressed: no ratio alarm, only the size the values would take.
    write_npz_bomb(path, values=MiB, compression=zipfile.ZIP_STORED)
    error, peak = peak_bytes_of(lambda: load_arrays(path, max_elements=1000))
    assert isinstance(error, UnsafeInputError)
    assert "declares more than 648,000 bytes once uncompressed" in str(error)
    assert peak < 8 * MiB


def npy_header_bomb(path):
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)}
        )
        f.write(b"\x00" * 64)


def test_npy_header_declaring_a_huge_shape_is_refused_before_reading(tmp_path):
    path = tmp_path / "h.npy"
    npy_header_bomb(path)
    error, peak = peak_bytes_of(lambda: load_arrays(path))
    assert isinstance(error, UnsafeInputError)
    assert "1,000,000,000,000 rows" in str(error) and "max_rows" in str(error)
    assert peak < 2 * MiB


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_pickled_object_array_is_refused_and_never_unpickled(tmp_path, suffix):
    canary = tmp_path / "canary.txt"
    gadget = np.array([WritesCanary(canary)], dtype=object)
    path = tmp_path / f"evil{suffix}"
    if suffix == ".npy":
        np.save(path, gadget, allow_pickle=True)
    else:
        np.savez(path, x=gadget)

    with pytest.raises(UnsafeInputError, match="dtype object.*pickle"):
        load_arrays(path)
    assert not canary.exists()

    # Control: the file is a working exploit for a careless reader.
    loaded = np.load(path, allow_pickle=True)
    if suffix == ".npz":
        loaded["x"]
    assert canary.exists()


def structured_npy(path):
    np.save(path, np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]))


def string_npy(path):
    np.save(path, np.array(["=cmd|' /C calc'!A0"]))


def truncated_npy(path):
    np.save(path, np.arange(100.0))
    data = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(data[:-8])


def traversal_npz(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("../../outside.npy", b"")


def not_npy_member_npz(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("payload.pkl", b"cos\nsystem\n")


def many_rows_csv(path):
    pathlib.Path(path).write_text("a,y\n" + "1,0\n" * 11)


def text_column_csv(path):
    pathlib.Path(path).write_text('a,y\n1,0\n=HYPERLINK("http://x"),1\n')


def missing_value_csv(path):
    pathlib.Path(path).write_text("a,y\n1,0\n,1\n")


def binary_csv(path):
    pathlib.Path(path).write_bytes(b"a,y\n\x00\x01\x02")


def big_csv(path):
    pathlib.Path(path).write_text("a,y\n" + "1,0\n" * 400)  # 1,604 bytes


@pytest.mark.parametrize(
    "name, build, kwargs, message",
    [
        ("s.npy", structured_npy, {}, "only numeric arrays"),
        ("u.npy", string_npy, {}, "only numeric arrays"),
        ("t.npy", truncated_npy, {}, "truncated or padded"),
        ("p.npz", traversal_npz, {}, "absolute path or one with '..'"),
        ("n.npz", not_npy_member_npz, {}, "not a .npy array"),
        ("r.csv", many_rows_csv, {"max_rows": 10}, "more than `max_rows`=10 rows"),
        ("c.csv", text_column_csv, {}, "Column 'a' of the .csv file is not numeric"),
        ("m.csv", missing_value_csv, {}, "missing or infinite value in data row 2"),
        ("b.csv", binary_csv, {}, "binary data"),
        ("big.csv", big_csv, {"max_bytes": 1000}, "over the limit of `max_bytes`=1,000"),
        ("x.pkl", lambda p: pathlib.Path(p).write_bytes(b"\x80\x04N."), {}, "not accepted"),
        ("fake.npz", lambda p: pathlib.Path(p).write_text("a,b\n1,2\n"), {}, "not a zip"),
    ],
)
def test_refusals_name_the_problem(tmp_path, name, build, kwargs, message):
    path = tmp_path / name
    build(path)
    with pytest.raises(UnsafeInputError) as caught:
        load_arrays(path, **kwargs)
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert not (tmp_path.parent.parent / "outside.npy").exists()


def test_csv_row_wider_than_the_header_is_refused_before_it_is_split(tmp_path):
    """pandas took 10 s and 300 MB on this 200 KB file, and kept 3 of its 100,000 values."""
    path = tmp_path / "wide.csv"
    path.write_text("a,b,y\n" + ",".join(["1"] * 100_000) + "\n")

    error, peak = peak_bytes_of(lambda: load_arrays(path))

    assert isinstance(error, UnsafeInputError), error
    assert "Line 2 of the .csv file has 100,000 values; the first row (line 1) has 3" in str(error)
    assert "at most 10,000 columns" in str(error)
    assert peak < 2 * MiB


@pytest.mark.parametrize(
    "text, message",
    [
        ("a,b,y\n1,2,0\n1,2,3,4\n", "Line 3 of the .csv file has 4 values, but the first row"),
        ("a,b,y\n1,2,0\n\n1,2\n", "Line 4 of the .csv file has 2 values, but the first row"),
        ("\n1,2,0\n3,4,5,6\n", "Line 3 of the .csv file has 4 values, but the first row (line 2)"),
        # The quoted comma is part of a column name, as pandas reads it too.
        ('"size, cm",y\n1,0\n2,1,5\n', "Line 3 of the .csv file has 3 values, but the first row"),
    ],
)
def test_csv_rows_of_another_width_than_the_first_are_refused(tmp_path, text, message):
    path = tmp_path / "d.csv"
    path.write_text(text)
    with pytest.raises(UnsafeInputError) as caught:
        load_arrays(path)
    assert message in str(caught.value)
    assert "one value per column" in str(caught.value)
    # Without the bad row, the same file loads.
    path.write_text("\n".join(text.splitlines()[:-1]) + "\n")
    assert load_arrays(path)["x"].shape[0] == 1


def test_csv_with_more_columns_than_the_cap_is_refused(tmp_path):
    def table(columns):
        names = ",".join(f"f{i}" for i in range(columns - 1)) + ",y"
        return f"{names}\n{','.join(['1'] * columns)}\n"

    path = tmp_path / "d.csv"
    path.write_text(table(10_000))
    assert load_arrays(path)["x"].shape == (1, 9_999)
    path.write_text(table(10_001))
    with pytest.raises(UnsafeInputError) as caught:
        load_arrays(path)
    assert "Line 1 of the .csv file has 10,001 values. gradflow reads at most 10,000" in str(
        caught.value
    )


def npy_bytes(array=None, header=None):
    """A .npy stream of `array`, or only a header declaring `{"descr", "shape"}`."""
    buffer = io.BytesIO()
    if array is not None:
        np.save(buffer, array)
    else:
        np.lib.format.write_array_header_1_0(buffer, {"fortran_order": False, **header})
    return buffer.getvalue()


@pytest.mark.parametrize(
    "name", ["./x.npy", "sub/x.npy", "x.npy.npy", "a..b.npy", ".x.npy", "é.npy"]
)
def test_npz_entries_that_are_not_plain_array_names_are_refused(tmp_path, name):
    """`x.npy` and `./x.npy` came back as two arrays, `x` and `./x`."""
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", npy_bytes(np.zeros((2, 3))))
        archive.writestr(name, npy_bytes(np.ones((2, 3))))
        archive.writestr("y.npy", npy_bytes(np.arange(2)))
    with pytest.raises(UnsafeInputError) as caught:
        load_arrays(path)
    assert f"The .npz entry {name!r} is not a plain array name" in str(caught.value)
    assert "np.savez(path, x=..., y=...)" in str(caught.value)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((0, 10**12), "has no examples: its shape is (0, 1000000000000)"),
        ((0,), "has no examples: its shape is (0,)"),
        ((5, 0), "holds no values: its shape (5, 0) has an axis of length 0"),
    ],
)
@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_arrays_with_an_axis_of_length_0_are_refused(tmp_path, shape, message, suffix):
    data = npy_bytes(header={"descr": "<f4", "shape": shape})
    path = tmp_path / f"d{suffix}"
    if suffix == ".npy":
        path.write_bytes(data)
    else:
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("x.npy", data)
            archive.writestr("y.npy", npy_bytes(np.arange(2)))

    error, peak = peak_bytes_of(lambda: load_arrays(path))

    assert isinstance(error, UnsafeInputError), error
    where = "Array 'x'" if suffix == ".npz" else "The .npy file"
    assert f"{where} {message}" in str(error)
    assert peak < 2 * MiB


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_complex_arrays_are_refused(tmp_path, dtype, suffix):
    x = np.ones((4, 2), dtype=dtype)
    path = tmp_path / f"d{suffix}"
    if suffix == ".npy":
        np.save(path, x)
    else:
        np.savez(path, x=x, y=np.zeros(4, dtype=bool))
    with pytest.raises(UnsafeInputError) as caught:
        load_arrays(path)
    assert f"has dtype {np.dtype(dtype)}: complex numbers are not accepted" in str(caught.value)
    assert "np.stack([x.real, x.imag], axis=-1)" in str(caught.value)


@pytest.mark.parametrize("argument", ["max_bytes", "max_rows", "max_elements"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_limit_arguments_are_validated(tmp_path, argument, value):
    with pytest.raises(ValueError, match=f"`{argument}` must be a positive integer, got"):
        load_arrays(tmp_path / "x.npz", **{argument: value})


# ---------------------------------------------------------------- properties

_NUMERIC_DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="="),
    hnp.unsigned_integer_dtypes(endianness="<"),
    hnp.floating_dtypes(endianness=">"),
)
_ARRAYS = hnp.arrays(_NUMERIC_DTYPES, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))


@settings(max_examples=60, deadline=None)
@given(
    arrays=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), _ARRAYS, max_size=4
    )
)
def test_random_numeric_arrays_round_trip_through_npz(arrays):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "d.npz")
        np.savez(path, **arrays)
        loaded = load_arrays(path)
    assert sorted(loaded) == sorted(arrays)
    for name, array in arrays.items():
        assert loaded[name].shape == array.shape
        assert loaded[name].dtype == array.dtype.newbyteorder("=")
        np.testing.assert_array_equal(loaded[name], array)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    suffix=st.sampled_from([".npz", ".npy", ".csv"]),
    data=st.one_of(
        st.binary(max_size=600),
        # Valid prefixes make the fuzzing reach past the magic-number checks.
        st.binary(max_size=300).map(lambda b: b"PK\x03\x04" + b),
        st.binary(max_size=300).map(lambda b: b"\x93NUMPY\x01\x00" + b),
        st.text(max_size=300).map(str.encode),
    ),
)
def test_random_bytes_only_ever_raise_unsafe_input_error(suffix, data):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "upload" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        try:
            result = load_arrays(path)
        except UnsafeInputError:
            return
    assert isinstance(result, dict)
    assert all(isinstance(v, np.ndarray) and v.dtype.kind in "biuf" for v in result.values())


@settings(max_examples=80, deadline=None)
@given(position=st.integers(min_value=0, max_value=10_000), byte=st.integers(0, 255))
def test_corrupted_npz_bytes_only_ever_raise_unsafe_input_error(position, byte):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "d.npz")
        np.savez_compressed(path, x=np.arange(40.0).reshape(8, 5), y=np.arange(8))
        data = bytearray(open(path, "rb").read())
        data[position % len(data)] = byte
        with open(path, "wb") as f:
            f.write(bytes(data))
        try:
            load_arrays(path)
        except UnsafeInputError:
            pass
