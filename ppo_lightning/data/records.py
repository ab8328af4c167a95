"""Records: one reader of records (a local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` file,
a ``save_to_disk`` directory or a Hugging Face dataset) that PPO's prompts and the stages' pairs
share.

``read_records`` yields every record as a dict with every field it has (consumers pick and check
the fields they need), and its errors name the config key, the file and the line.
``PromptRecord`` is one PPO prompt (a string or chat messages) with its metadata columns.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


from ppo_lightning.config.errors import ConfigError

log = logging.getLogger(__name__)


# the files read_records reads, by extension, as its errors describe them ("": .txt's format)
RECORD_FILES = {
    ".txt": ".txt (one prompt a line)",
    ".jsonl": ".jsonl (one JSON object a line)",
    ".json": ".json (a JSON list of objects)",
    ".parquet": ".parquet (one row a record)",
}
SAVED_DATASET = "a directory written by datasets' save_to_disk"


def record_formats() -> str:
    """What a records path may be, for errors: every ``RECORD_FILES`` format, or a saved dataset."""
    return f"{', '.join(RECORD_FILES.values())} or {SAVED_DATASET}"


# ----------------------------------------------------------------------------- records
def records_source(key_prefix: str, path: str | Path | None = None, hf_dataset: str | None = None) -> str:
    """How errors name a source of records: ``data.path='p.jsonl'``, ``task.hf_dataset='org/x'``."""
    if path is not None:
        return f"{key_prefix}.path={str(path)!r}"
    return f"{key_prefix}.hf_dataset={hf_dataset!r}"


def read_records(
    key_prefix: str,
    *,
    path: str | Path | None = None,
    hf_dataset: str | None = None,
    hf_split: str = "train",
    text_field: str = "prompt",
    suffixes: Sequence[str] = (".txt", ".jsonl", ".json", ".parquet"),
) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each record of ``path`` (or, when it is None, of ``hf_dataset``), in order.

    ``where`` names the record for error messages (``data.path='p.jsonl' line 3``). A record is a
    dict holding every field of its object or row; which fields matter, and their types, is the
    caller's to check. Files, by extension (of ``suffixes``; ``.txt`` includes no extension):

    - ``.txt``: one record ``{text_field: line}`` per non-empty line, the line as it is (split
      on ``"\\n"`` only: ``str.splitlines`` would also split a prompt at form feeds or U+2028);
    - ``.jsonl``: one JSON object a line, blank lines skipped;
    - ``.json``: a JSON list of objects;
    - ``.parquet``: one record a row (needs ``pyarrow``: ``pip install ppo_lightning[data]``);
    - a directory written by ``datasets``' ``save_to_disk``: its rows, or its ``hf_split``'s
      rows when it holds a ``DatasetDict`` (needs ``datasets``).

    A Hugging Face dataset (needs ``datasets``) gives its ``hf_split`` rows, every column kept.
    Errors are ``ConfigError``s naming ``<key_prefix>.path`` / ``.hf_dataset``.
    """
    source = records_source(key_prefix, path, hf_dataset)
    if path is None:
        yield from _hf_rows(hf_dataset, hf_split, source, key_prefix)
        return
    path = Path(path)
    if path.is_dir():
        yield from _saved_rows(path, hf_split, source, key_prefix)
        return
    if not path.is_file():
        raise ConfigError(f"{source}: no such file or directory")
    suffix = _suffix(path, suffixes, source)
    if suffix == ".parquet":
        yield from _parquet_rows(path, source, key_prefix)
    elif suffix == ".txt":
        yield from _txt_rows(path, source, text_field)
    elif suffix == ".jsonl":
        yield from _jsonl_rows(path, source)
    else:
        yield from _json_rows(path, source)


def _suffix(path: Path, suffixes: Sequence[str], source: str) -> str:
    """The file's format by extension (none: ``.txt``), refused unless one of ``suffixes``."""
    suffix = ".txt" if path.suffix == "" else path.suffix
    if suffix not in suffixes:
        formats = [RECORD_FILES[s] for s in suffixes]
        listed = formats[0] if len(formats) == 1 else f"{', '.join(formats[:-1])} or {formats[-1]}"
        raise ConfigError(f"{source}: unsupported extension {path.suffix!r}; use {listed}")
    return suffix


def _txt_rows(path: Path, source: str, text_field: str) -> Iterator[tuple[str, dict]]:
    """One record ``{text_field: line}`` per non-empty line, split on ``"\\n"`` only."""
    lines = path.read_text(encoding="utf-8").split("\n")
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            yield f"{source} line {lineno}", {text_field: line.rstrip("\r")}


def _jsonl_rows(path: Path, source: str) -> Iterator[tuple[str, dict]]:
    """One JSON object a line, blank lines skipped."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{source} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            yield where, _object(obj, where)


def _json_rows(path: Path, source: str) -> Iterator[tuple[str, dict]]:
    """The objects of one JSON list."""
    try:
        objs = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{source} line {e.lineno}: not valid JSON ({e.msg}); a .json file must hold one list of objects"
        ) from None
    if not isinstance(objs, list):
        raise ConfigError(f"{source}: expected a JSON list of objects, got a {type(objs).__name__}")
    for i, obj in enumerate(objs):
        where = f"{source} record {i}"
        yield where, _object(obj, where)


def _object(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _import(module: str, source: str, key_prefix: str):
    """``module``, or a ``ConfigError`` saying how to install it (the ``data`` extra)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ConfigError(
            f"{source} needs the {package!r} package: pip install 'ppo_lightning[data]' (or give a "
            f".jsonl file with {key_prefix}.path=...)"
        ) from None


def _parquet_rows(path: Path, source: str, key_prefix: str) -> Iterator[tuple[str, dict]]:
    pq = _import("pyarrow.parquet", source, key_prefix)
    try:
        table = pq.read_table(path)
    except Exception as e:  # not parquet, truncated: the file is the user's to fix
        raise ConfigError(f"{source}: not a readable parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{source} row {i}", row


def _saved_rows(path: Path, split: str, source: str, key_prefix: str) -> Iterator[tuple[str, dict]]:
    if not any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
        raise ConfigError(f"{source} is a directory but not {SAVED_DATASET}; give a file or such a directory")
    datasets = _import("datasets", source, key_prefix)
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise ConfigError(f"{source}: could not be loaded as {SAVED_DATASET} ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(
                f"{source} holds the splits {sorted(ds)}, not {split!r}; set {key_prefix}.hf_split to one of them"
            )
        ds, source = ds[split], f"{source} split {split!r}"
    for i, row in enumerate(ds):
        yield f"{source} row {i}", dict(row)


def _hf_rows(name: str, split: str, source: str, key_prefix: str) -> Iterator[tuple[str, dict]]:
    datasets = _import("datasets", source, key_prefix)
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network, missing split, bad name: all user-fixable
        raise ConfigError(
            f"{source} (split {split!r}) could not be loaded: {e}. For offline use give a "
            f"local file with {key_prefix}.path=..."
        ) from None
    for i, row in enumerate(ds):
        yield f"{source} row {i}", dict(row)


# ----------------------------------------------------------------------------- PPO prompts
@dataclasses.dataclass
class PromptRecord:
    """One prompt as the user wrote it, with the rest of its record.

    ``prompt`` is a string or a list of chat messages (``{"role", "content"}`` dicts); ``columns``
    holds every other field of the record (``answer``, ``data_source``, ...): the prompt's
    metadata, which travels with it through the rollout to the reward."""

    prompt: str | list[dict[str, str]]
    columns: dict[str, Any]
    where: str  # how errors name it: data.path='p.jsonl' line 3

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


def read_prompt_records(
    path: str | Path | None = None,
    field: str = "prompt",
    hf_dataset: str | None = None,
    hf_split: str = "train",
    key_prefix: str = "data",
) -> list[PromptRecord]:
    """PPO's prompt records from ``path`` (``.txt``: one prompt a line; ``.jsonl`` / ``.json``:
    objects with a ``field``) or ``hf_dataset``. A prompt is a string or a non-empty list of
    messages, each a ``{"role": str, "content": str}`` object; a dataset's non-string scalar is
    taken as its string. Errors name the file and line."""
    records = []
    for where, row in read_records(key_prefix, path=path, hf_dataset=hf_dataset, hf_split=hf_split, text_field=field):
        if field not in row:
            raise ConfigError(
                f"{where}: no {field!r} field (data.prompt_field={field!r}); its fields are {sorted(row)}"
            )
        prompt = row[field]
        if hf_dataset is not None and path is None and not isinstance(prompt, (str, list)):
            prompt = str(prompt)
        if isinstance(prompt, list):
            check_messages(prompt, where, field)
        elif not isinstance(prompt, str):
            raise ConfigError(
                f"{where}: expected an object with a string {field!r} field or a list of chat messages "
                f"(data.prompt_field={field!r}), got {type(prompt).__name__}"
            )
        records.append(PromptRecord(prompt, {k: v for k, v in row.items() if k != field}, where))
    if not records:
        raise ConfigError(f"{records_source(key_prefix, path, hf_dataset)} holds no prompts; add one prompt per line")
    return records


def check_messages(messages: list, where: str, field: str) -> None:
    """A non-empty list of ``{"role": str, "content": str}`` objects, or a ``ConfigError`` naming ``where``."""
    if not messages:
        raise ConfigError(f"{where}: {field!r} is an empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(
                f"{where}: message {i} of {field!r} must be an object with string 'role' and 'content' "
                f"fields, got {m!r}"
            )


def read_prompts(path: str | Path, field: str = "prompt", key_prefix: str = "data") -> list[str | list[dict[str, str]]]:
    """The prompts of a file, as ``read_prompt_records`` reads them."""
    return [r.prompt for r in read_prompt_records(path, field, key_prefix=key_prefix)]
