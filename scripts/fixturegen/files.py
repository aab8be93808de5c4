"""Files as the hub writes them: JSON indented by two, tensor names in natural (numeric-aware) order."""

from __future__ import annotations

import json
import re
from pathlib import Path


def natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

