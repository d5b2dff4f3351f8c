"""Concurrent publishers on a local folder, moto and Ceph RGW: nothing lost, nothing overwritten.

Publishers run at once (threads sharing the session's model; and, on a local
folder, two `kvcdn publish` processes), and are held at the riskiest moment,
all objects uploaded and the manifest not yet created, until every one of
them is there. Afterwards every version must load and every object every
manifest names must hold exactly the bytes it names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from kvcdn.catalog import read_manifest, read_pointer, versions
from kvcdn.document import source_digest
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.conftest import all_intact

LEVELS = "int8,fp16"


def _at_once(n: int):
    """A progress callback that holds each publisher, objects uploaded and manifest not yet
    created, until all ``n`` are there."""
    barrier = threading.Barrier(n, timeout=300)

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "upload" and done == total:
            barrier.wait()

    return progress


def _publish_all(model, store, jobs: list[tuple[str, str]]):
    progress = _at_once(len(jobs))
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(
                publish, text=text, name=name, model=model, store=store, levels=LEVELS,
                progress=progress,
            )
            for name, text in jobs
        ]  # fmt: skip
        return [f.result() for f in futures]


def test_two_documents_sharing_a_prefix(store, model, sed_text):
    shared = sed_text[:3000]
    a, b = shared + sed_text[3000:3600], shared + sed_text[6000:6600]
    results = _publish_all(model, store, [("alpha", a), ("beta", b)])
    assert [r.version for r in results] == [1, 1]
    assert all_intact(store, model) == 2
    alpha, beta = read_manifest(store, "alpha"), read_manifest(store, "beta")
    shared_chunks = [
        (c, d) for c, d in zip(alpha.chunks, beta.chunks, strict=False) if c.hash == d.hash
    ]
    assert len(shared_chunks) >= 2  # the prefix spans whole chunks
    for c, d in shared_chunks:
        for level, ref in c.objects.items():
            # one key per byte string: the same bytes are one object, other bytes another
            assert (ref.key == d.objects[level].key) == (ref.sha256 == d.objects[level].sha256)


def test_one_text_under_two_names_at_once_shares_every_object(store, model, short_text):
    results = _publish_all(model, store, [("first", short_text), ("second", short_text)])
    assert [r.version for r in results] == [1, 1]
    first, second = read_manifest(store, "first"), read_manifest(store, "second")
    assert [c.objects for c in first.chunks] == [c.objects for c in second.chunks]
    assert all_intact(store, model) == 2


def test_two_versions_of_one_name_at_once(store, model, sed_text):
    texts = [sed_text[:2500], sed_text[:2000] + sed_text[5000:5500]]
    results = _publish_all(model, store, [("doc", t) for t in texts])
    assert sorted(r.version for r in results) == [1, 2]  # the loser took the next version
    assert versions(store, "doc") == [1, 2]
    assert read_pointer(store, "doc").version == 2
    published = {read_manifest(store, "doc", v).source_sha256 for v in (1, 2)}
    assert published == {source_digest(t) for t in texts}
    assert all_intact(store, model) == 2


def test_the_same_text_published_twice_at_once(store, model, short_text):
    results = _publish_all(model, store, [("same", short_text), ("same", short_text)])
    assert [r.version for r in results] == [1, 1]
    assert sorted(r.unchanged for r in results) == [False, True]
    assert versions(store, "same") == [1]
    assert all_intact(store, model) == 1


def test_two_publish_processes_at_once(model, sed_text, tmp_path):
    """The reported case itself: two `kvcdn publish` runs of one name into one folder."""
    root = tmp_path / "store"
    docs = []
    for i, text in enumerate([sed_text[:2500], sed_text[:2500] + "\nOne more line.\n"]):
        path = tmp_path / f"v{i}" / "guide.md"
        path.parent.mkdir()
        path.write_text(text)
        docs.append(path)
    env = {**os.environ, "KVCDN_STORE": str(root)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvcdn.cli.main", "publish", str(p), "--levels", LEVELS],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for p in docs
    ]  # fmt: skip
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
    store = open_store(str(root))
    assert versions(store, "guide") == [1, 2]
    assert all_intact(store, model) == 2
