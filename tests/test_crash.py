"""Crash safety: a publish killed between objects and manifest loses nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvcdn import sdk
from kvcdn.catalog import versions
from kvcdn.profile import LADDER
from kvcdn.publish import publish
from kvcdn.store import open_store

KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from kvcdn.publish import publish

    stored = []

    def on_object(key):
        stored.append(key)
        if len(stored) == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: a real crash

    publish(sys.argv[1], store=sys.argv[2], on_object=on_object)
    """
)


def _objects(root):
    return {
        p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in root.glob("objects/**/*.kvc")
    }


def test_killed_publish_keeps_the_previous_version_and_resumes(model, short_text, tmp_path):
    root = tmp_path / "store"
    doc = tmp_path / "guide.md"
    doc.write_text(short_text)
    assert publish(doc, model=model, store=str(root)).version == 1
    before = _objects(root)

    # Change the middle: every chunk from there on is new (prefix chaining).
    doc.write_text(short_text[:1200] + "\nAn inserted sentence.\n" + short_text[1200:])
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(doc), str(root), "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]

    store = open_store(str(root))
    assert versions(store, "guide") == [1]  # no partial version is visible
    ctx = sdk.load_context("guide", store=str(root), model=model)
    assert ctx.manifest.version == 1 and ctx.token_ids  # the old version still loads
    after_crash = _objects(root)
    leftovers = set(after_crash) - set(before)
    assert len(leftovers) >= 2  # the crash came after several objects were stored

    v2 = publish(doc, model=model, store=str(root))
    assert v2.version == 2
    assert v2.uploaded_objects + v2.reused_objects == v2.chunks * len(LADDER)
    final = _objects(root)
    # Only what was still missing went up; the leftovers were verified and reused.
    assert len(set(final) - set(before)) == len(leftovers) + v2.uploaded_objects
    # + the first chunk's objects, which come before the change
    assert v2.reused_objects >= len(leftovers) + len(LADDER)
    for key in leftovers:  # finished objects were not uploaded again
        assert final[key] == after_crash[key]
    assert versions(store, "guide") == [1, 2]
    assert sdk.load_context("guide", store=str(root), model=model).manifest.version == 2
