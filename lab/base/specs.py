"""Read job specs from YAML or JSON files, with dotted command-line overrides."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import yaml

from engine.spec import JobSpec, SpecError


def read_spec_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SpecError("SPEC", f"no such file: {path}")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0]
        raise SpecError("SPEC", f"{path} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}") from None
    if data is None:
        data = {}
    return data


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """``steps=50`` or ``compressor.name=topk``; values are parsed as YAML scalars."""
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides or ():
        if "=" not in item:
            raise SpecError("--set", f"expected FIELD=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw else ""
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            cur = node.get(part)
            if isinstance(cur, str):  # short form `model: cnn` -> {name: cnn}
                cur = {"mode" if part == "comm" else "link" if part == "network" else "name": cur}
            if cur is None:
                cur = {}
            if not isinstance(cur, dict):
                raise SpecError(key, f"cannot set a field inside {part}, which is {cur!r}")
            node[part] = cur
            node = cur
        node[parts[-1]] = value
    return data


def load_spec(path: Optional[str] = None, overrides: Iterable[str] = (), data: Optional[dict] = None) -> JobSpec:
    if data is None:
        data = read_spec_file(path) if path else {}
    return JobSpec.from_dict(apply_overrides(data, overrides))
