"""The elements of a top-level JSON array, decoded one by one from a file.

The packaged ShareGPT file is large and ends mid-record: reading stops at the first incomplete
element, and never holds more than a chunk of the file beyond the element being decoded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def iter_json_array(path: Path, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array without holding the whole file in memory."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars).lstrip().lstrip("["), 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
