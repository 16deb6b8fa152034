"""JSONL prompt datasets with a field mapping: any file with one JSON object per line becomes PromptRecords.

Rows are validated when the file is loaded, not when a row is first sampled hours into a run: a bad line fails at
start-up with the file and line number in one message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from megatron_rl.data.records import DataError, PromptRecord, check_messages

_MISSING = object()


def _get_field(row: dict, name: str) -> Any:
    """row[name], or a nested value for a dotted name ("meta.answer") when no key has the dotted name itself."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


class JsonlPromptDataset(Sequence[PromptRecord]):
    """Prompt records from a JSONL file.

    prompt_field: the field holding the prompt text (or a list of chat messages).
    answer_field: the field holding the reference answer; None for datasets without one.
    id_field: a field to use as the record id; by default `<name>/<line number>`.
    answer_transform: turns the raw answer value into the reference string (e.g. keep what follows `####`).
    metadata_fields: other fields to keep in each record's metadata; by default all the remaining fields.
    raw_answer_key: keep the untransformed answer in the metadata under this key (GSM8K keeps its worked solution).
    limit: read at most this many records.
    """

    def __init__(self, path: Union[str, Path], prompt_field: str = "prompt", answer_field: Optional[str] = "answer",
                 id_field: Optional[str] = None, answer_transform: Optional[Callable[[Any], str]] = None,
                 metadata_fields: Optional[Sequence[str]] = None, raw_answer_key: Optional[str] = None,
                 name: Optional[str] = None, limit: Optional[int] = None):
        self.path = Path(path)
        self.name = name or self.path.stem
        self.raw_answer_key = raw_answer_key
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such file")
        self.records: list[PromptRecord] = []
        with self.path.open("rb") as f:  # decoded line by line, so that bad bytes are named by their line
            for lineno, raw in enumerate(f, start=1):
                if limit is not None and len(self.records) >= limit:
                    break
                where = f"{self.path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") \
                        from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
                self.records.append(self._record(row, where, lineno, prompt_field, answer_field, id_field,
                                                 answer_transform, metadata_fields))
        if not self.records:
            raise DataError(f"{self.path}: no records")

    def _record(self, row: dict, where: str, lineno: int, prompt_field: str, answer_field: Optional[str],
                id_field: Optional[str], answer_transform, metadata_fields) -> PromptRecord:
        def missing(field: str, role: str) -> DataError:
            keys = ", ".join(sorted(row)) or "none"
            return DataError(f"{where}: no {role} field {field!r} (the row has: {keys})")

        prompt = _get_field(row, prompt_field)
        if prompt is _MISSING:
            raise missing(prompt_field, "prompt")
        if not isinstance(prompt, str):
            check_messages(prompt, where=f"{where}: field {prompt_field!r}")
        elif not prompt.strip():
            raise DataError(f"{where}: the prompt field {prompt_field!r} is empty")
        reference = None
        if answer_field is not None:
            raw = _get_field(row, answer_field)
            if raw is _MISSING:
                raise missing(answer_field, "answer")
            try:
                reference = answer_transform(raw) if answer_transform else _as_text(raw)
            except (ValueError, TypeError) as e:
                raise DataError(f"{where}: field {answer_field!r}: {e}") from None
        if id_field is not None:
            rid = _get_field(row, id_field)
            if rid is _MISSING:
                raise missing(id_field, "id")
            rid = str(rid)
        else:
            rid = f"{self.name}/{lineno}"
        used = {prompt_field, answer_field, id_field}
        keep = metadata_fields if metadata_fields is not None else [k for k in row if k not in used]
        metadata = {k: row[k] for k in keep if k in row}
        if self.raw_answer_key is not None and answer_field is not None:
            metadata[self.raw_answer_key] = _get_field(row, answer_field)
        metadata["source"] = where
        return PromptRecord(id=rid, prompt=prompt, reference=reference, metadata=metadata)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]

    def __repr__(self) -> str:
        return f"JsonlPromptDataset({str(self.path)!r}, {len(self)} records)"


def _as_text(value: Any) -> str:
    """A reference answer as text: strings as they are, numbers without a trailing '.0'."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise ValueError(f"expected a string or a number, got {value!r:.60}")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
