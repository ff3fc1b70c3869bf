"""Zip archive checks shared by `.keras` models and `.npz` arrays.

Everything here reads only the archive's directory records, never member
data, so a hostile archive costs a few kilobytes of memory to refuse.
`zipfile.ZipFile` itself builds one object per directory entry, so the entry
count is read from the end-of-central-directory record *before* the archive is
handed to `zipfile`.
"""

import os
import struct
import zipfile
import zlib

from gradflow.safety.errors import UnsafeInputError

ZIP_MAGIC = b"PK\x03\x04"
EMPTY_ZIP_MAGIC = b"PK\x05\x06"  # an archive with no entries starts with its end record
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"

_EOCD_SIGNATURE = b"PK\x05\x06"
_EOCD_FORMAT = "<4s4H2LH"
_EOCD_SIZE = struct.calcsize(_EOCD_FORMAT)  # 22 bytes
_MAX_COMMENT = 0xFFFF
# Stored (no compression) and DEFLATE are what Keras and NumPy write; bzip2 and
# LZMA reach far higher expansion ratios and are never needed here.
_ALLOWED_COMPRESSION = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
# Small members may compress extremely well (a config of zeros); only members
# that are both large and highly compressed look like bombs.
_RATIO_FLOOR_BYTES = 1 << 20
# General-purpose flag bits we understand: deflate options (1, 2), data
# descriptor (3), UTF-8 names (11). Encryption (0, 6) and patched data (5) are refused.
_KNOWN_FLAG_BITS = 0b0000_1000_0000_1110
# What `zipfile` and `zlib` raise on corrupt member data.
CORRUPT_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,
)


def check_file_size(path, max_bytes, what):
    """Returns the size of the regular file at `path`, refusing larger ones."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise UnsafeInputError(f"Cannot read the {what} at {os.fspath(path)!r}: {e}.") from e
    if not os.path.isfile(path):
        raise UnsafeInputError(
            f"The {what} at {os.fspath(path)!r} is not a regular file. Upload a single file."
        )
    if info.st_size > max_bytes:
        raise UnsafeInputError(
            f"The {what} is {info.st_size:,} bytes, over the limit of "
            f"`max_bytes`={max_bytes:,}. Upload a smaller file or raise `max_bytes`."
        )
    return info.st_size


def read_head(path, n=8):
    with open(path, "rb") as f:
        return f.read(n)


def zip_entry_count(path, size, max_entries, what):
    """Reads the entry count from the end record, before `zipfile` parses the directory."""
    tail_length = min(size, _EOCD_SIZE + _MAX_COMMENT)
    with open(path, "rb") as f:
        f.seek(size - tail_length)
        tail = f.read(tail_length)
    start = tail.rfind(_EOCD_SIGNATURE)
    if start < 0 or len(tail) - start < _EOCD_SIZE:
        raise UnsafeInputError(
            f"The {what} is not a valid zip archive (no end-of-directory record)."
        )
    (_, disk, cd_disk, entries_here, entries, cd_size, cd_offset, _) = struct.unpack(
        _EOCD_FORMAT, tail[start : start + _EOCD_SIZE]
    )
    if 0xFFFF in (disk, cd_disk, entries_here, entries) or 0xFFFFFFFF in (cd_size, cd_offset):
        raise UnsafeInputError(
            f"The {what} is a ZIP64 or multi-part archive; files this large are not accepted."
        )
    if entries != entries_here or disk or cd_disk:
        raise UnsafeInputError(f"The {what} is a multi-part zip archive, which is not accepted.")
    if entries > max_entries:
        raise UnsafeInputError(
            f"The {what} has {entries:,} entries, over the limit of `max_entries`={max_entries:,}."
        )
    return entries


def open_checked_zip(path, *, what, max_bytes, max_entries, max_total_bytes, max_ratio):
    """Opens a zip archive after checking its structure, reading no member data.

    Args:
        path: path of the archive.
        what: words for messages, e.g. `"model file"`.
        max_bytes: largest archive size on disk.
        max_entries: most entries in the archive.
        max_total_bytes: largest total uncompressed size of all members.
        max_ratio: largest uncompressed/compressed ratio of a member over 1 MiB.

    Returns:
        An open `zipfile.ZipFile`; the caller closes it.

    Raises:
        UnsafeInputError: for anything outside those limits, absolute or `..`
            entry names, duplicate names, folders, encryption, or compression
            other than stored/DEFLATE.
    """
    size = check_file_size(path, max_bytes, what)
    if read_head(path, 4) not in (ZIP_MAGIC, EMPTY_ZIP_MAGIC):
        raise UnsafeInputError(f"The {what} is not a zip archive.")
    zip_entry_count(path, size, max_entries, what)
    try:
        archive = zipfile.ZipFile(path, "r")
    except (*CORRUPT_ZIP_ERRORS, ValueError, struct.error) as e:
        raise UnsafeInputError(f"The {what} is not a valid zip archive: {e}.") from e
    try:
        _check_members(archive, what, max_total_bytes, max_ratio)
    except BaseException:
        archive.close()
        raise
    return archive


def _check_members(archive, what, max_total_bytes, max_ratio):
    seen = set()
    total = 0
    for info in archive.infolist():
        name = info.filename
        check_member_name(name, what)
        if name in seen:
            raise UnsafeInputError(f"The {what} contains the entry {name!r} twice.")
        seen.add(name)
        if info.flag_bits & ~_KNOWN_FLAG_BITS:
            raise UnsafeInputError(
                f"The {what} entry {name!r} is encrypted or uses zip features "
                f"(flags {info.flag_bits:#06x}) that are not accepted."
            )
        if info.compress_type not in _ALLOWED_COMPRESSION:
            raise UnsafeInputError(
                f"The {what} entry {name!r} uses compression method {info.compress_type}; "
                "only stored or DEFLATE entries are accepted."
            )
        if info.file_size > _RATIO_FLOOR_BYTES and info.file_size > max_ratio * max(
            info.compress_size, 1
        ):
            raise UnsafeInputError(
                f"The {what} entry {name!r} expands from {info.compress_size:,} to "
                f"{info.file_size:,} bytes (more than {max_ratio}:1): this looks like a "
                "zip bomb and was not decompressed."
            )
        total += info.file_size
        if total > max_total_bytes:
            raise UnsafeInputError(
                f"The {what} declares more than {max_total_bytes:,} bytes once "
                f"uncompressed (at entry {name!r}); it was not decompressed. "
                "Upload a smaller file."
            )


def check_member_name(name, what):
    """Refuses entry names that could escape a folder if ever extracted."""
    parts = name.replace("\\", "/").split("/")
    if (
        not name
        or "\x00" in name
        or name.startswith(("/", "\\"))
        or (len(name) > 1 and name[1] == ":")
        or ".." in parts
    ):
        raise UnsafeInputError(
            f"The {what} contains the entry name {name!r}, an absolute path or one "
            "with '..'; such archives try to write outside their folder."
        )
    if name.endswith("/"):
        raise UnsafeInputError(f"The {what} contains a folder entry {name!r}; none is expected.")


def read_member(archive, name, limit, what):
    """Reads one member, never more than `limit` bytes whatever its header says."""
    try:
        with archive.open(name, "r") as f:
            data = f.read(limit + 1)
    except CORRUPT_ZIP_ERRORS as e:
        raise UnsafeInputError(f"The {what} entry {name!r} is corrupt: {e}.") from e
    if len(data) > limit:
        raise UnsafeInputError(
            f"The {what} entry {name!r} is larger than its limit of {limit:,} bytes."
        )
    return data
