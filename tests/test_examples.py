"""The programs in examples/ run as a user runs them, each in a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stdout


def test_ask_a_document_publishes_once_then_loads(tmp_path):
    store = str(tmp_path / "kv")
    first = _run(str(EXAMPLES / "ask_a_document.py"), "--store", store, "What is sed?")
    assert "publishing sed-manual" in first and "A: " in first
    again = _run(str(EXAMPLES / "ask_a_document.py"), "--store", store, "What does -n do?",
                 "What is sed?")  # fmt: skip
    assert "publishing" not in again  # the second run only loads
    assert again.count("A: ") == 2 and "loaded sed-manual@1" in again


@pytest.mark.usefixtures("moto_endpoint")  # moto is importable and its server runs here
def test_edges_over_s3_fail_over():
    out = _run(str(EXAMPLES / "edges_over_s3.py"))
    first, after = (line for line in out.splitlines() if "chunks served by" in line)
    stopped = re.search(r"after stopping (\S+):", after).group(1)
    served_after = after.split("chunks served by", 1)[1]
    assert stopped in first and stopped not in served_after  # the other edge took over
    assert re.search(r"'http://127\.0\.0\.1:\d+': \d+", served_after)
    assert "A: " in out


def test_blend_documents(tmp_path):
    out = _run(str(EXAMPLES / "blend_documents.py"), "--store", str(tmp_path / "kv"))
    assert "blended sed-options@1 + sed-commands@1" in out
    assert "kvcdn: " in out and "prefill: " in out
