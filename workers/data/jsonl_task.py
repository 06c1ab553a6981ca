"""The `jsonl` task type: one prompt per line, text or a list of text / image / audio / video parts.

A media part gives its bytes as exactly one of `path` (read at load, relative to the file), `uri` (a reference
the workers open) or `base64` (inline; `mime` required). Every bad line is reported at once, with its number.

Local media files are read from one directory only (`media_root`: the option, else the file's own directory), at
load and by the workers alike (`read_inside`): a path that leads outside it (`..`, an absolute path, a symlink out)
or to anything but a regular file (`/dev/zero`, a FIFO) is refused with one line.
"""

from __future__ import annotations

import base64
import binascii
import json
import mimetypes
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.parts import AudioPart, ImagePart, MediaRef, Part, TextPart, VideoPart
from workers.data.task_items import TaskItem, check_limit, report_errors

_PartModel = type[TextPart] | type[ImagePart] | type[AudioPart] | type[VideoPart]
_MEDIA_TYPES: dict[str, _PartModel] = {
    "image": ImagePart,
    "audio": AudioPart,
    "video": VideoPart,
}


def jsonl_lines(file: Path, what: str) -> list[tuple[int, str]]:
    """The non-blank lines of a JSON Lines file with their 1-based numbers; ValueError naming `what` and the file
    when it cannot be read (missing, unreadable, not UTF-8)."""
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {str(file)!r} cannot be read: {getattr(err, 'strerror', None) or err}") from None
    return [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]


def jsonl(
    path: str | Path, task: str = "jsonl", limit: int | None = None, media_root: str | Path | None = None
) -> list[TaskItem]:
    """One item per non-blank line; every bad line is reported at once, with its line number."""
    check_limit("jsonl", limit)
    file = Path(path)
    root = jsonl_media_root(file, media_root)
    items: list[TaskItem] = []
    errors: list[tuple[int, str]] = []
    for lineno, line in jsonl_lines(file, "jsonl task file"):
        try:
            parts, answer, name = parse_record(line, file.parent, root)
        except ValueError as err:
            errors.append((lineno, _describe(err)))
            continue
        items.append(TaskItem(parts=parts, answer=answer, task=name or task, index=len(items)))
    if errors:
        raise ValueError(report_errors(f"{file}", "line", errors))
    if not items:
        raise ValueError(f"{file}: no tasks (the file has no non-blank line)")
    return items[:limit]


def jsonl_media_root(path: str | Path, media_root: str | Path | None = None) -> Path:
    """The directory a jsonl file's media are read from: `media_root`, else the file's own directory (absolute)."""
    return Path(media_root if media_root is not None else Path(path).parent).absolute()


def task_media_root(task: Any) -> Path | None:
    """The directory a run's local media files are read from (`jsonl_media_root`); None when the task has no file
    of its own (then no local media file is read at all)."""
    options = getattr(task, "options", None)
    if getattr(task, "type", None) != "jsonl" or options is None:
        return None
    return jsonl_media_root(options.path, options.media_root)


def media_file(path: str | Path, root: Path | None) -> Path:
    """`path` with every symlink followed, if it is a regular file inside `root`; ValueError (one line) otherwise:
    no root, a path out of it, a device, a FIFO, a directory, a missing file."""
    if root is None:
        raise ValueError(f"{str(path)!r}: this run reads no local media file (only a jsonl task's directory)")
    try:
        base = root.resolve(strict=True)
    except (OSError, RuntimeError) as err:
        raise ValueError(f"media root {str(root)!r} cannot be used: {getattr(err, 'strerror', None) or err}") from None
    try:
        real = Path(path).resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError) as err:
        raise ValueError(f"{str(path)!r} cannot be read: {getattr(err, 'strerror', None) or err}") from None
    if not real.is_relative_to(base):
        raise ValueError(f"{str(path)!r} is outside {str(base)!r}, the only directory media files are read from")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{str(path)!r} is not a regular file")
    return real


def read_inside(path: str | Path, root: Path | None) -> bytes:
    """The bytes of `path` if `media_file` accepts it; ValueError (one line) otherwise."""
    real = media_file(path, root)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO swapped in would block without it
    except OSError as err:
        raise ValueError(f"{str(path)!r} cannot be read: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # what was opened: nothing swapped in since the check
            raise ValueError(f"{str(path)!r} is not a regular file")
        return f.read()


def parse_record(line: str, base: Path, root: Path) -> tuple[tuple[Part, ...], str | None, str | None]:
    """Parts, answer and task name of one JSONL line; ValueError says what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:  # a "\udXXX" JSON escape with no pair: no message could carry it
        bad = err.object[err.start : err.end]
        raise ValueError(f"holds {bad!r}, a lone surrogate, which is not valid Unicode text") from None
    if "prompt" not in record:
        raise ValueError("missing 'prompt'")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        parts: tuple[Part, ...] = (TextPart(text=prompt),)
    elif isinstance(prompt, list) and prompt:
        parts = tuple(_parse_part(p, i, base, root) for i, p in enumerate(prompt))
    else:
        raise ValueError("'prompt' must be a string or a non-empty list of parts")
    answer = record.get("answer")
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    elif answer is not None and not isinstance(answer, str):
        raise ValueError(f"'answer' must be a string, a number or null, got {type(answer).__name__}")
    name = record.get("task")
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError("'task' must be a non-empty string")
    return parts, answer, name


def _parse_part(part: Any, i: int, base: Path, root: Path) -> Part:
    """One element of a prompt list: text as is, media from a `path` (read inline), a `uri` (a reference) or
    `base64` bytes (inline; `mime` required)."""
    where = f"prompt[{i}]"
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        return _validate(TextPart, part, where)
    model = _MEDIA_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"{where} has unknown type {kind!r} (known: text, {', '.join(_MEDIA_TYPES)})")
    fields = dict(part)
    path, uri, b64 = fields.pop("path", None), fields.pop("uri", None), fields.pop("base64", None)
    if sum(x is not None for x in (path, uri, b64)) != 1:
        raise ValueError(f"{where} ({kind}) needs exactly one of 'path', 'uri' or 'base64'")
    if b64 is not None:
        if "mime" not in fields:
            raise ValueError(f"{where} ({kind}) with 'base64' needs a 'mime'")
        try:
            fields["inline"] = base64.b64decode(str(b64), validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"{where} ({kind}) 'base64' is not valid base64: {err}") from None
        return _validate(model, fields, where)
    source = str(path if path is not None else uri)
    if "mime" not in fields:
        guessed, _ = mimetypes.guess_type(source)
        if guessed is None:
            raise ValueError(f"{where} ({kind}) has no 'mime' and none can be guessed from {source!r}")
        fields["mime"] = guessed
    if path is not None:
        try:
            fields["inline"] = read_inside(base / str(path), root)
        except ValueError as err:
            raise ValueError(f"{where} ({kind}): {err}") from None
    else:
        fields["ref"] = MediaRef(uri=source)
    return _validate(model, fields, where)


def _validate(model: _PartModel, fields: dict[str, Any], where: str) -> Part:
    try:
        return model.model_validate(fields)
    except ValidationError as err:
        raise ValueError(f"{where} ({fields.get('type')}): {_describe(err)}") from None


def _describe(err: ValueError) -> str:
    """One readable line for a parse error; pydantic errors become `field: message; ...`."""
    if isinstance(err, ValidationError):
        return "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'value'}: {e['msg']}" for e in err.errors(include_url=False)
        )
    return str(err)
