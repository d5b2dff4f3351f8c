"""Crash safety: a publish killed between objects and manifest loses nothing, on a local
folder, moto and Ceph RGW."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvcdn import sdk
from kvcdn.catalog import versions
from kvcdn.check import check_store
from kvcdn.codec_profile import LADDER
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.cli_json import parsed
from tests.conftest import s3_target

KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    stored = []

    def on_object(key):
        stored.append(key)
        if len(stored) == int(sys.argv[4]):
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: a real crash

    store = open_store(sys.argv[2], endpoint_url=sys.argv[3] or None)
    publish(sys.argv[1], store=store, on_object=on_object)
    """
)


@pytest.fixture(params=["local", "moto", pytest.param("ceph", marks=pytest.mark.ceph)])
def target(request, tmp_path):
    """(store URL, endpoint URL or "") of a fresh store."""
    if request.param == "local":
        yield str(tmp_path / "store"), ""
        return
    for s3 in s3_target(request, request.param):
        yield s3.url(), s3.endpoint


def _objects(store) -> dict[str, int]:
    return {k: n for k, n in store.list_sizes("objects/").items() if k.endswith(".kvc")}


def test_killed_publish_keeps_the_previous_version_and_resumes(model, short_text, tmp_path, target):
    url, endpoint = target
    store = open_store(url, endpoint_url=endpoint or None)
    doc = tmp_path / "guide.md"
    doc.write_text(short_text)
    assert publish(doc, model=model, store=store).version == 1
    before = _objects(store)

    # Change the middle: every chunk from there on is new (prefix chaining).
    doc.write_text(short_text[:1200] + "\nAn inserted sentence.\n" + short_text[1200:])
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(doc), url, endpoint, "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert killed.returncode == -9, killed.stderr[-2000:]

    assert versions(store, "guide") == [1]  # no partial version is visible
    ctx = sdk.load_context("guide", store=store, model=model)
    assert ctx.manifest.version == 1 and ctx.token_ids  # the old version still loads
    after_crash = _objects(store)
    leftovers = set(after_crash) - set(before)
    assert len(leftovers) >= 2  # the crash came after several objects were stored
    # `kvcdn check`: the store is intact; what the crash left is orphaned, nothing more
    checked = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "check", "--store", url, "--json",
         *(["--endpoint-url", endpoint] if endpoint else [])],
        capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    report = parsed("check", checked.stdout)
    assert report["ok"] and report["problems"] == []
    assert set(report["orphans"]) == leftovers

    v2 = publish(doc, model=model, store=store)
    assert v2.version == 2
    assert v2.uploaded_objects + v2.reused_objects == v2.chunks * len(LADDER)
    final = _objects(store)
    loaded_v2 = sdk.load_context("guide", store=store, model=model)
    assert loaded_v2.manifest.version == 2
    named = {ref.key for c in loaded_v2.manifest.chunks for ref in c.objects.values()}
    # Only what was still missing went up: a leftover this run named held the very
    # bytes it computed (its key is their sha256), so it was checked and kept.
    assert len(set(final) - set(before)) == len(leftovers) + v2.uploaded_objects
    kept = leftovers & named
    # + the first chunk's objects, which come before the change
    assert v2.reused_objects >= len(kept) + len(LADDER)
    # A leftover it did not name holds other bytes for the same chunk and level: the
    # killed run, in another process, computed other bytes for them. CI saw it once in
    # about ten runs (neither leftover named, 5 objects reused); 40 runs here, in one
    # process and across processes, and the suite's own order, did not repeat it.
    # PyTorch does not promise bit-identical floats across processes. This run then
    # stores its own bytes beside the leftover, which stays an orphan for `kvcdn gc`.
    superseded = leftovers - named
    for key in superseded:
        chunk_folder, level_and_sha = key.rsplit("/", 1)
        level_id = level_and_sha.split(".", 1)[0]
        assert any(k.startswith(f"{chunk_folder}/{level_id}.") for k in named), key
    assert versions(store, "guide") == [1, 2]
    report = check_store(store)
    assert report.ok and set(report.orphans) == superseded  # the new version names the rest
