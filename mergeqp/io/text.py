"""Text files users write (merge configs, prompt files), read as UTF-8 with errors that say where.

A file saved in another encoding (Latin-1, or UTF-16 as some editors' "Unicode" option writes)
failed with Python's ``'utf-8' codec can't decode byte 0xe9 in position 37`` (a raw traceback for a
config, a byte offset for a prompt file); :func:`read_text` names the file, the line and column,
and for a UTF-16 byte-order mark the encoding to save it in instead.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ValidationError

__all__ = ["read_text"]

_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def read_text(path: str | Path, what: str) -> str:
    """The text of ``path`` (UTF-8; a leading byte-order mark dropped; ``"\r\n"`` and ``"\r"``
    read as ``"\n"``, as ``Path.read_text`` reads them), or a :class:`~mergeqp.errors.ValidationError`
    naming ``what`` (e.g. ``"config"``), the file and, for bytes that are not UTF-8, their line
    and column."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ValidationError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    if raw.startswith(_UTF16_BOMS):
        raise ValidationError(f"{what} {p} is UTF-16 text (it starts with a UTF-16 byte-order mark): save it as UTF-8")
    try:
        return raw.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        before = raw[:exc.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n")  # (the lines read)
        line = before.count(b"\n") + 1
        column = len(before) - (before.rfind(b"\n") + 1) + 1
        raise ValidationError(f"{what} {p} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column "
                              f"{column} (save it as UTF-8)") from None
