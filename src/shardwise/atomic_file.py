"""Files written whole or not at all: the data go to a temporary file of this writer's own (its
process and thread in the name, so that concurrent writers never share one), which then replaces
the file. A reader sees the old file or the new one, never part of either; a writer that fails
leaves the old file as it was and no temporary behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_whole(path: Path, data: bytes) -> None:
    """Replace `path`'s contents with `data`, whole or not at all."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
