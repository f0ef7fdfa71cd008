"""Parquet through the storage layer, with integrity on by default.

Every file is written with page checksums and read back with checksum verification, so a
flipped bit is an error instead of a silently wrong value; a truncated file fails its
footer check. Errors name the file's URL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.contracts import FileEntry
from pipeline.storage import Storage, WrittenObject
from pipeline.verified import check_bytes


class ParquetFileError(ValueError):
    """A Parquet file is corrupt, truncated or has an unexpected schema."""


def write_table(storage: Storage, key: str, table: pa.Table, *,
                row_group_size: int | None = None) -> WrittenObject:
    """Atomically write ``table`` to ``key``; returns size and sha256 of the bytes."""
    with storage.open_write(key) as f:
        pq.write_table(table, f, row_group_size=row_group_size, write_page_checksum=True,
                       compression="zstd", write_statistics=False)
    return WrittenObject(key, f.bytes, f.hexdigest())


def read_table(storage: Storage, key: str, schema: pa.Schema | None = None, *,
               entry: FileEntry | None = None) -> pa.Table:
    """Read ``key`` whole, verifying page checksums; ``schema`` casts on read. With the
    file's manifest ``entry``, its size and sha256 are checked on the same bytes first."""
    try:
        if entry is not None:
            data = storage.read_bytes(key)
            check_bytes(storage.url(key), entry, data)
            table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
        else:
            with storage.open_read(key) as f:
                table = pq.read_table(f, page_checksum_verification=True)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ParquetFileError(f"{storage.url(key)}: corrupt or truncated Parquet ({e})") from e
    if schema is not None:
        try:
            table = table.select(schema.names).cast(schema)
        except (pa.ArrowException, KeyError, ValueError) as e:
            raise ParquetFileError(f"{storage.url(key)}: schema mismatch ({e})") from e
    return table


@contextlib.contextmanager
def open_parquet(storage: Storage, key: str) -> Iterator[pq.ParquetFile]:
    """``key`` as a ParquetFile that verifies page checksums on read; closed on exit."""
    local = storage.local_path(key)
    if local is not None and not local.is_file():
        raise FileNotFoundError(f"{storage.url(key)} does not exist")
    # pyarrow reads a local path natively; other filesystems go through fsspec's file.
    with contextlib.ExitStack() as stack:
        source = str(local) if local is not None else stack.enter_context(
            storage.open_read(key))
        try:
            pf = stack.enter_context(pq.ParquetFile(source, page_checksum_verification=True))
        except (pa.ArrowException, OSError) as e:
            raise ParquetFileError(
                f"{storage.url(key)}: corrupt or truncated Parquet ({e})") from e
        yield pf
