"""What `data.path` names, and the documents in it: text files, JSON Lines, Parquet and Arrow
files, and Hugging Face datasets saved to disk, read in pieces so that several processes can
tokenize one corpus (prepare.py).

- `.txt`: the file is one document. `.jsonl`: each non-blank line is one, its `data.text_field`.
  Either may be compressed, `.txt.gz`, `.jsonl.zst` and so on (gzip, or Zstandard with the
  zstandard package), and may begin with a UTF-8 byte-order mark, which is not text.
- `.parquet`, `.arrow`, `.feather`: each row is one, its `data.text_field` column (a string
  column). Arrow means the IPC file format or the IPC stream format, told apart by the file's
  first bytes. Tables are read with pyarrow a batch of rows at a time (Arrow files memory-mapped),
  never whole.
- A directory written by `datasets`' `save_to_disk`: a dataset (`state.json`, whose
  `_data_files` list its Arrow stream files in order) or a dataset dict (`dataset_dict.json`, a
  dataset per split; `data.split` picks one). Read with pyarrow: `datasets` is not needed.
- Any other directory: every file above under it, in sorted path order; a glob: its matches.

A corpus is cut into pieces, each a range of one file (lines of a JSON Lines file by byte
offset, row groups of a Parquet file, record batches of an Arrow file; a compressed file, which
cannot be entered in the middle, is one piece), so a large file is
tokenized by several processes; the documents of the pieces in order are the corpus's, however
it is cut. Everything that can be checked without reading the text (a file that is not the format
its name says, a missing column, a column that is not text, a missing split) is checked when the
pieces are planned, before any process starts.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shardwise.config.schema import ConfigError

TEXT, JSONL, PARQUET, ARROW_FILE, ARROW_STREAM = "txt", "jsonl", "parquet", "arrow-file", "arrow-stream"
KINDS = {".txt": TEXT, ".jsonl": JSONL, ".parquet": PARQUET, ".arrow": ARROW_FILE, ".feather": ARROW_FILE}
COMPRESSIONS = (".gz", ".zst")  # of a text or JSON Lines file (a table compresses its own columns)
SUFFIXES = (*KINDS, *(f"{kind}{c}" for kind in (".txt", ".jsonl") for c in COMPRESSIONS))
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which some editors write first: not text
ROWS = 1024  # rows of a table converted to Python strings at once
ARROW_MAGIC = b"ARROW1"  # how an Arrow IPC file begins (a stream begins with a message)


@dataclass(frozen=True)
class Source:
    """One input file and how its documents are read (an Arrow file's kind is settled by `pieces`);
    `compression`: a text or JSON Lines file's, `.gz` or `.zst` (None: none)."""

    path: Path
    kind: str
    compression: str | None = None


def suffix_of(path: Path) -> str:
    """The suffix that says how `path` is read: `.jsonl`, or `.jsonl.gz` for a compressed one."""
    if path.suffix in COMPRESSIONS:
        return "".join(path.suffixes[-2:])
    return path.suffix


def source_of(path: Path) -> Source:
    """A file of one of SUFFIXES as a source."""
    suffix = suffix_of(path)
    compression = path.suffix if path.suffix in COMPRESSIONS else None
    return Source(path, KINDS[suffix.removesuffix(compression or "")], compression)


@dataclass(frozen=True)
class Piece:
    """Part of one file: bytes [start, stop) of a JSON Lines file (the lines that begin there), row
    groups [start, stop) of a Parquet file, record batches [start, stop) of an Arrow one, or a
    whole text file (0, 1). `size`: its bytes, of a table its text column's (uncompressed): the
    measure of its work, by which parts are made and progress is counted."""

    source: Source
    start: int
    stop: int
    size: int


def input_sources(path: str, split: str | None = None, what: str = "data.path") -> list[Source]:
    """The files `path` (data.path or data.val_path, named by `what`) names, in the order their
    documents are read. `split`: data.split, the split of a dataset dict to read (None: no split
    chosen, so a dataset dict is refused)."""
    given = Path(path).expanduser()
    if given.is_dir() and (given / "dataset_dict.json").is_file():
        return _dataset_dict(given, path, split, what)
    sources = _saved_dataset(given, path, what) if (given / "state.json").is_file() else _files(given, path, what)
    if split not in (None, "train"):
        raise ConfigError(f"data.split = {split!r}: {what} = {path!r} has no splits (a Hugging Face dataset dict "
                          "saved to disk has); leave data.split out")
    return sources


def _files(given: Path, path: str, what: str) -> list[Source]:
    """A file, every readable file under a directory, or a glob's matches."""
    if given.is_file():
        files = [given]
    elif given.is_dir():
        files = sorted(p for p in given.rglob("*") if suffix_of(p) in SUFFIXES and p.is_file())
        saved = next((p.parent for p in sorted(given.rglob("*.json")) if p.name in ("state.json", "dataset_dict.json")),
                     None)
        if saved is not None:
            raise ConfigError(f"{what} = {path!r}: {saved} is a saved Hugging Face dataset; name it as {what} itself "
                              "(its files are read in its own order)")
    else:
        files = sorted(Path(p) for p in glob.glob(str(given), recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"{what} = {path!r}: no such file, directory or glob match")
    unknown = [p for p in files if suffix_of(p) not in SUFFIXES]
    if unknown:
        raise ConfigError(f"{what} = {path!r}: {unknown[0]} is none of {', '.join(SUFFIXES)}")
    if not files:
        raise ConfigError(f"{what} = {path!r}: no {', '.join(SUFFIXES)} files in it")
    return [source_of(p) for p in files]


def _dataset_dict(root: Path, path: str, split: str | None, what: str) -> list[Source]:
    """A DatasetDict saved to disk: the dataset of split `split`."""
    splits = _json(root / "dataset_dict.json", what).get("splits", [])
    if split is None:
        raise ConfigError(f"data.val_path = {path!r}: a dataset dict (splits {', '.join(splits)}); name the split to "
                          f"validate on as its directory, e.g. {root / (splits[-1] if splits else 'validation')}")
    if split not in splits or not (root / split / "state.json").is_file():
        raise ConfigError(f"data.split = {split!r}: {what} = {path!r} has no such split (its splits: "
                          f"{', '.join(splits) or 'none'})")
    return _saved_dataset(root / split, path, what)


def _saved_dataset(root: Path, path: str, what: str) -> list[Source]:
    """A Dataset saved to disk: its Arrow files, in the order state.json lists them."""
    names = [entry.get("filename") for entry in _json(root / "state.json", what).get("_data_files", [])]
    if not names:
        raise ConfigError(f"{what} = {path!r}: {root / 'state.json'} lists no data files")
    files = [root / name for name in names]
    missing = next((f for f in files if not f.is_file()), None)
    if missing is not None:
        raise ConfigError(f"{what} = {path!r}: {missing}, listed in {root / 'state.json'}, is missing")
    return [Source(f, ARROW_FILE) for f in files]


def _json(file: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{what}: {file} is not readable JSON ({_first_line(error)})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: {file} is not a JSON object")
    return value


def pieces(sources: list[Source], text_field: str, piece_bytes: int) -> list[Piece]:
    """Every source cut into pieces of about `piece_bytes` (a text file whole; a Parquet row group
    or an Arrow record batch at least), in document order; each table checked: readable, with a
    text column `text_field`."""
    cut = []
    for source in sources:
        size = source.path.stat().st_size
        if source.kind == TEXT or source.compression:
            cut.append(Piece(source, 0, 1, size))
        elif source.kind == JSONL:
            cut += [Piece(source, a, min(a + piece_bytes, size), min(piece_bytes, size - a))
                    for a in range(0, size, piece_bytes)]
        else:
            source, sizes = _table(source, text_field)
            cut += _group(source, sizes, piece_bytes)
    return cut


def _group(source: Source, sizes: list[int], piece_bytes: int) -> list[Piece]:
    """Consecutive row groups or record batches (of `sizes` bytes of text) as pieces of about `piece_bytes`."""
    grouped, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        held += size
        if held >= piece_bytes or i == len(sizes) - 1:
            grouped.append(Piece(source, start, i + 1, held))
            start, held = i + 1, 0
    return grouped


def _table(source: Source, text_field: str) -> tuple[Source, list[int]]:
    """A Parquet or Arrow file's kind (an Arrow file or stream) and the bytes of text (column
    `text_field`, uncompressed) in each row group or record batch, the column checked to be text.
    Reads only metadata (an Arrow file's batches where they lie, memory-mapped)."""
    pa = _pyarrow()
    path = source.path
    try:
        if source.kind == PARQUET:
            import pyarrow.parquet as pq

            with pq.ParquetFile(path) as table:
                schema = table.schema_arrow
                groups = [table.metadata.row_group(i) for i in range(table.num_row_groups)]
                sizes = [sum(group.column(j).total_uncompressed_size for j in range(group.num_columns)
                             if group.column(j).path_in_schema == text_field) for group in groups]
        else:
            with open(path, "rb") as f:
                is_file = f.read(len(ARROW_MAGIC)) == ARROW_MAGIC
            source = Source(path, ARROW_FILE if is_file else ARROW_STREAM)
            with _arrow_reader(source) as reader:
                schema = reader.schema
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if is_file else reader
                sizes = [_column_bytes(batch, text_field) for batch in batches]
    except (pa.ArrowException, OSError) as error:
        what = "a Parquet file" if source.kind == PARQUET else "an Arrow IPC file or stream"
        raise ConfigError(f"data.path: {path} is not {what} that can be read ({_first_line(error)})") from None
    if text_field not in schema.names:
        raise ConfigError(f"data.text_field = {text_field!r}: {path} has no such column (its columns: "
                          f"{', '.join(schema.names)})")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_string_view(pa, kind)):
        raise ConfigError(f"data.text_field = {text_field!r}: {path}'s column of that name holds {kind}, not text "
                          "(a string column)")
    return source, sizes


def _column_bytes(batch: Any, name: str) -> int:
    """The bytes of a record batch's column `name` (its buffers' sizes: none of it is read), else 0."""
    return batch.column(name).nbytes if name in batch.schema.names else 0


def _is_string_view(pa: Any, kind: Any) -> bool:
    return hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind)


def _arrow_reader(source: Source) -> Any:
    """An Arrow file's or stream's reader over a memory map (batches are read where they lie)."""
    pa = _pyarrow()
    mapped = pa.memory_map(str(source.path))
    return pa.ipc.open_file(mapped) if source.kind == ARROW_FILE else pa.ipc.open_stream(mapped)


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401  (pyarrow.ipc is a submodule: imported so that pa.ipc resolves)
    except ImportError:
        raise ConfigError("data.path: Parquet and Arrow files need the pyarrow package "
                          "(pip install 'shardwise[data]')") from None
    return pyarrow


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def documents(piece: Piece, text_field: str) -> Iterator[str]:
    """The texts of the documents that `piece` holds, in order."""
    kind, path = piece.source.kind, piece.source.path
    if kind == TEXT:
        with _opened(piece.source) as f:
            yield f.read().removeprefix(BOM).decode("utf-8", errors="replace")
    elif kind == JSONL and piece.source.compression:
        with _opened(piece.source) as f:
            for number, raw in enumerate(f, start=1):
                text = _json_line(raw.removeprefix(BOM) if number == 1 else raw, path, lambda n=number: n, text_field)
                if text is not None:
                    yield text
    elif kind == JSONL:
        yield from _json_lines(path, piece.start, piece.stop, text_field)
    else:
        for texts in _table_texts(piece, text_field):
            yield from texts


def _json_lines(path: Path, start: int, stop: int, text_field: str) -> Iterator[str]:
    """The texts of the lines of a JSON Lines file that begin at bytes [start, stop)."""
    for raw, position in _raw_lines(path, start, stop):
        text = _json_line(raw, path, lambda at=position: _line_number(path, at), text_field)
        if text is not None:
            yield text


def _raw_lines(path: Path, start: int, stop: int) -> Iterator[tuple[bytes, int]]:
    """The lines of a file that begin at bytes [start, stop), each with where it begins (the first
    line's byte-order mark dropped)."""
    with open(path, "rb") as f:
        position = start
        if start > 0:  # the line that began before `start` is the previous piece's
            f.seek(start - 1)
            position += len(f.readline()) - 1
        while position < stop:
            raw = f.readline()
            if not raw:
                return
            yield raw.removeprefix(BOM) if position == 0 else raw, position
            position += len(raw)


def records(piece: Piece) -> Iterator[tuple[dict, Callable[[], str]]]:
    """The JSON objects of the lines of a JSON Lines `piece`, each with a function naming where it
    is (for errors): what a fine-tuning format reads (samples.py)."""
    source, path = piece.source, piece.source.path
    if source.kind != JSONL:
        raise ConfigError(f"data.format: {path} is not JSON Lines; chat and completion samples are read from .jsonl "
                          "files, one sample a line")
    for raw, line_number in _numbered_lines(piece):
        record = _json_record(raw, path, line_number)
        if record is None:
            continue
        if not isinstance(record, dict):
            raise ConfigError(f"data.path: {path}, line {line_number()}: not a JSON object")
        yield record, lambda line_number=line_number: f"{path}, line {line_number()}"


def _numbered_lines(piece: Piece) -> Iterator[tuple[bytes, Callable[[], int]]]:
    """The lines of a JSON Lines `piece` as they are read (the first's byte-order mark dropped), each
    with a function giving its number (counted only when asked, for an uncompressed file)."""
    source, path = piece.source, piece.source.path
    if source.compression:
        with _opened(source) as f:
            for number, raw in enumerate(f, start=1):
                yield raw.removeprefix(BOM) if number == 1 else raw, lambda n=number: n
    else:
        for raw, at in _raw_lines(path, piece.start, piece.stop):
            yield raw, lambda at=at: _line_number(path, at)


def _json_record(raw: bytes, path: Path, line_number: Callable[[], int]) -> Any:
    """The JSON value of one line of a JSON Lines file (None for a blank one); `line_number` names
    it in an error."""
    line = raw.decode("utf-8", errors="replace")
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"data.path: {path}, line {line_number()}: not JSON ({error.msg})") from None


def _json_line(raw: bytes, path: Path, line_number: Callable[[], int], text_field: str) -> str | None:
    """The text of one line of a JSON Lines file (None for a blank one)."""
    record = _json_record(raw, path, line_number)
    if record is None:
        return None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ConfigError(f"data.text_field = {text_field!r}: {path}, line {line_number()} has no such text field")
    return text


def _opened(source: Source) -> IO[bytes]:
    """A text or JSON Lines file opened for reading its bytes, decompressed."""
    if source.compression == ".gz":
        return gzip.open(source.path, "rb")
    if source.compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"data.path: {source.path} is Zstandard-compressed, which needs the zstandard package "
                              "(pip install 'shardwise[data]')") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(source.path, "rb"), closefd=True))
    return open(source.path, "rb")


def _line_number(path: Path, position: int) -> int:
    """The number (from 1) of the line that begins at byte `position`: for errors only, so counted then."""
    with open(path, "rb") as f:
        return f.read(position).count(b"\n") + 1


def _table_texts(piece: Piece, text_field: str) -> Iterator[list[str]]:
    """A Parquet or Arrow piece's texts, ROWS at a time (a row that is null refused, its row named)."""
    source, path = piece.source, piece.source.path
    if source.kind == PARQUET:
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as table:
            first = sum(table.metadata.row_group(i).num_rows for i in range(piece.start))
            groups = list(range(piece.start, piece.stop))
            for batch in table.iter_batches(ROWS, row_groups=groups, columns=[text_field]):
                yield _texts(batch.column(0), path, text_field, first)
                first += batch.num_rows
        return
    with _arrow_reader(source) as reader:
        if source.kind == ARROW_FILE:
            batches = (reader.get_batch(i) for i in range(piece.stop))
        else:
            batches = (batch for _, batch in zip(range(piece.stop), reader, strict=False))
        first = 0
        for i, batch in enumerate(batches):
            if i >= piece.start:
                column = batch.column(text_field)
                for offset in range(0, len(column), ROWS):
                    yield _texts(column.slice(offset, ROWS), path, text_field, first + offset)
            first += batch.num_rows


def _texts(column: Any, path: Path, text_field: str, first_row: int) -> list[str]:
    texts = column.to_pylist()
    if column.null_count:
        row = first_row + texts.index(None)
        raise ConfigError(f"data.text_field = {text_field!r}: {path}, row {row} (from 0) is null, not text")
    return texts
