"""The ``--json`` schema of docs/cli.schema.json, for the tests that read CLI output."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "cli.schema.json"


@cache
def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


def commands() -> list[str]:
    """The commands the schema specifies (``keys new`` is ``keys_new``)."""
    return sorted(_schema()["$defs"])


def parsed(command: str, stdout: str) -> Any:
    """``stdout`` parsed, after checking it against the command's documented schema."""
    data = json.loads(stdout)
    schema = {**_schema(), "$ref": f"#/$defs/{command}"}
    jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)
    return data
