"""`kvcdn publish --ray`: a corpus of real man pages published by actors of a real
local Ray cluster (2 CPUs, started once per session) gives exactly what a serial
publish gives, and survives an actor killed mid-corpus."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest

from kvcdn import sdk
from kvcdn.catalog import read_manifest, versions
from kvcdn.cluster import CorpusDocument, PublishSettings, publish_on_ray
from kvcdn.document import document_and_name, expand_documents
from kvcdn.keys import parse_key
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.cli_json import parsed

# six: three an actor, so that the other actor is still busy when one is killed
PAGES = ["sed", "ls", "cp", "mv", "sort", "chmod"]
QUESTION = "What does this command do?"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six man pages (their first 2,500 characters), one file each."""
    folder = tmp_path_factory.mktemp("corpus")
    for page in PAGES:
        text = subprocess.run(
            f"man -P cat {page} | col -bx", shell=True, capture_output=True, text=True,
            check=True, env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin"},
        ).stdout  # fmt: skip
        assert len(text) > 1500, page
        (folder / f"{page}.txt").write_text(text[:2500])
    return folder


def _documents(folder) -> list[CorpusDocument]:
    out = []
    for path in expand_documents([folder]):
        text, name = document_and_name(path, None, None)
        out.append(CorpusDocument(name, text, str(path)))
    return out


def _snapshot(store) -> tuple[dict, dict]:
    """Every manifest (without its timestamp) and every object's bytes."""
    manifests, objects = {}, {}
    for key in store.list(""):
        info = parse_key(key)
        if info is None:
            continue
        if info.kind == "manifest":
            m = read_manifest(store, info.name, info.version)
            manifests[key] = dataclasses.replace(m, created_at="")
        elif info.kind == "object":
            objects[key] = store.get(key)
    return manifests, objects


def test_a_corpus_on_two_actors_is_the_serial_publish(ray_cluster, model, corpus, tmp_path):
    documents = _documents(corpus)
    assert len(documents) == len(PAGES)
    serial = open_store(str(tmp_path / "serial"))
    for doc in documents:
        publish(text=doc.text, name=doc.name, model=model, store=serial, levels="int8")

    fanned = open_store(str(tmp_path / "ray"))
    seen = []
    report = publish_on_ray(
        documents, PublishSettings(store=fanned.url, levels="int8", threads=1), actors=2,
        on_outcome=seen.append,
    )  # fmt: skip
    assert report.actors == 2 and not report.failed and len(seen) == len(PAGES)
    assert {o.actor for o in report.outcomes} == {0, 1}  # both actors published
    assert all(o.attempts == 1 and o.result.version == 1 for o in report.outcomes)
    assert _snapshot(fanned) == _snapshot(serial)  # same manifests, same objects

    for doc in documents[:3]:
        ctx = sdk.load_context(doc.name, model=model, store=fanned, quality="int8")
        assert set(ctx.plan.chunk_levels) == {"int8"}
        answer = ctx.generate(QUESTION, max_new_tokens=8)
        assert (
            answer.token_ids[0] == ctx.answer_with_prefill(QUESTION, max_new_tokens=8).token_ids[0]
        )


def test_an_actor_killed_mid_corpus(ray_cluster, corpus, tmp_path):
    documents = _documents(corpus)
    store = open_store(str(tmp_path / "store"))
    pids: set[int] = set()
    killed: list[int] = []

    def kill_the_other(outcome) -> None:
        pids.add(outcome.pid)
        if len(pids) == 2 and not killed:  # the other actor is busy with a document
            victim = next(p for p in pids if p != outcome.pid)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    report = publish_on_ray(
        documents, PublishSettings(store=store.url, levels="int8", threads=1), actors=2,
        on_outcome=kill_the_other,
    )  # fmt: skip
    assert killed and report.actor_restarts == 1
    assert not report.failed and all(o.ok for o in report.outcomes)
    retried = [o for o in report.outcomes if o.attempts == 2]
    assert len(retried) == 1 and killed[0] not in {o.pid for o in retried}
    for doc in documents:  # each published once: one version, complete
        assert versions(store, doc.name) == [1]
        m = read_manifest(store, doc.name)
        for chunk in m.chunks:
            for ref in chunk.objects.values():
                store.get(ref.key, max_bytes=ref.bytes, check=ref.check)


def test_cli_joins_a_cluster_and_reports_json(ray_cluster, corpus, tmp_path):
    store = tmp_path / "store"
    files = [str(corpus / f"{p}.txt") for p in ("sed", "ls", "cp")]
    result = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "publish", *files, "--levels", "int8",
         "--ray", ray_cluster, "--actors", "1", "--store", str(store), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = parsed("publish_ray", result.stdout)
    assert sorted(d["name"] for d in report["published"]) == ["cp", "ls", "sed"]
    assert report["failed"] == [] and report["actors"] == 1
    # published again: idempotent, every document unchanged
    again = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "publish", str(corpus / "sed.txt"),
         "--levels", "int8", "--ray", ray_cluster, "--store", str(store), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert [d["unchanged"] for d in parsed("publish_ray", again.stdout)["published"]] == [True]


def test_without_ray_the_cli_says_how_to_get_it(corpus, tmp_path):
    hide_ray = (
        "import sys; sys.modules['ray'] = None; from kvcdn.cli.main import main; "
        f"sys.argv = ['kvcdn', 'publish', {str(corpus / 'sed.txt')!r}, '--ray', '--store', "
        f"{str(tmp_path)!r}]; main()"
    )
    result = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert "pip install 'kvcdn[ray]'" in result.stderr and "Traceback" not in result.stderr


def test_actors_the_cluster_cannot_place_are_refused(ray_cluster, corpus, tmp_path):
    from kvcdn.errors import InputError

    documents = _documents(corpus)[:1]
    settings = PublishSettings(store=str(tmp_path / "store"), levels="int8", threads=1)
    with pytest.raises(InputError, match="need 3 CPUs; the cluster has 2"):
        publish_on_ray(documents, settings, actors=3)
    with pytest.raises(InputError, match="has no GPU"):
        publish_on_ray(documents, dataclasses.replace(settings, device="cuda"))


def test_a_document_that_fails_is_named_and_the_rest_published(ray_cluster, corpus, tmp_path):
    # the whole bash manual is longer than the model's context: a user mistake, not retried
    long_doc = tmp_path / "bash.txt"
    long_doc.write_text(
        subprocess.run("man -P cat bash | col -bx", shell=True, capture_output=True, text=True,
                       check=True, env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin"}).stdout
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "publish", str(corpus / "sed.txt"),
         str(long_doc), "--levels", "int8", "--ray", ray_cluster, "--actors", "1",
         "--store", str(tmp_path / "store"), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 1
    report = parsed("publish_ray", result.stdout)
    assert [d["name"] for d in report["published"]] == ["sed"]
    [failed] = report["failed"]
    assert failed["name"] == "bash" and failed["attempts"] == 1
    assert "context window" in failed["error"]
    assert "failed:" in result.stderr and str(long_doc) in result.stderr
    assert "Traceback" not in result.stderr
