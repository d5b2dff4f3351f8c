"""Every input checked before use: SDK arguments, document names of any script, questions
longer than the context window, and warming an edge without its admin token."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvcdn import sdk
from kvcdn.cli.main import cli
from kvcdn.document import document_and_name
from kvcdn.errors import ArgumentError, DocumentTooLong, InputError
from kvcdn.keys import check_name, manifest_key, name_from_filename, parse_key
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.cli_json import parsed
from tests.edge_helpers import EdgeProcess

LEVEL = "int8"


@pytest.fixture(scope="module")
def published(model, short_text, tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs") / "store"
    publish(text=short_text, name="guide", model=model, store=str(root), levels=LEVEL)
    return root


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"store": 123}, "store must be a store URL or a Store, not int"),
        ({"quality": 3}, "quality must be a level name"),
        ({"deadline_s": "1"}, "deadline_s must be a number of seconds, not str"),
        ({"deadline_s": float("nan")}, "deadline_s must be a positive number"),
        ({"edges": "http://127.0.0.1:9"}, "edges must be a list of edge URLs, not str"),
        ({"edges": [8080]}, "an edge URL must be a string"),
        ({"model": 7}, "model must be a model name or a loaded model"),
        ({"trust": 5}, "trust must be a TrustPolicy or a trust file's path"),
        ({"endpoint_url": 5}, "endpoint_url must be a string"),
        ({"policy": "greedy"}, "policy must be a planner function like kvcdn.sdk.planner.plan"),
        ({"predictor": "fast"}, "predictor must be a throughput predictor"),
        ({"predictor": object()}, "it has no predict_seconds or observe"),
        ({"cancel_late_fetches": "no"}, "cancel_late_fetches must be True or False, not str"),
        ({"cancel_late_fetches": 0}, "cancel_late_fetches must be True or False, not int"),
    ],
)
def test_load_context_arguments_of_the_wrong_type(published, kwargs, message):
    with pytest.raises((ArgumentError, InputError)) as refused:
        sdk.load_context("guide", **{"store": str(published), **kwargs})
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"blend": "no"}, "blend must be True or False, not str"),
        ({"recompute_ratio": "all"}, "recompute_ratio must be a number from 0 to 1"),
        ({"question": 5}, "question must be a string"),
    ],
)
def test_load_contexts_arguments_are_checked_at_the_door(published, kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        sdk.load_contexts(["guide", "guide"], store=str(published), **kwargs)


def test_wrong_sources_and_answers(published, model):
    with pytest.raises(TypeError, match="source must be a document name, a path or a text"):
        sdk.load_context(None, store=str(published))  # an ArgumentError is a TypeError
    with pytest.raises(ArgumentError, match="sources must be a list of documents, not str"):
        sdk.load_contexts("guide", store=str(published))
    with pytest.raises(ArgumentError, match="recompute_ratio must be a number from 0 to 1"):
        sdk.load_contexts(["guide"], store=str(published), recompute_ratio="all")
    ctx = sdk.load_context("guide", model=model, store=str(published), quality=LEVEL)
    with pytest.raises(ArgumentError, match="question must be a string, not NoneType"):
        ctx.generate(None)
    with pytest.raises(ArgumentError, match="max_new_tokens must be from 1"):
        ctx.generate("What is sed?", max_new_tokens=0)
    with pytest.raises(ArgumentError, match="max_new_tokens must be an integer"):
        ctx.generate("What is sed?", max_new_tokens=2.5)
    with pytest.raises(ArgumentError, match="the question is empty"):
        ctx.generate("   ")


def test_a_question_longer_than_the_context_window_is_refused_at_once(published, model):
    ctx = sdk.load_context("guide", model=model, store=str(published), quality=LEVEL)
    with pytest.raises(DocumentTooLong, match="context window of 8,192"):
        ctx.generate("Why? " * 9000)
    with pytest.raises(ArgumentError, match="more than a context window of 8,192 tokens can hold"):
        ctx.generate("x" * 300_000)  # refused before tokenizing it
    # the context still answers after refusing
    assert ctx.generate("What is sed?", max_new_tokens=4).text
    result = CliRunner().invoke(
        cli, ["ask", "guide", "Why? " * 9000, "--store", str(published), "--level", LEVEL]
    )
    assert result.exit_code == 2
    assert result.output.startswith("error: the question is") and "context window" in result.output


@pytest.mark.parametrize(
    "stem, name",
    [
        ("my file ünï", "my-file-ünï"),
        ("日本語のマニュアル", "日本語のマニュアル"),
        ("Cafe\u0301", "Café"),  # NFD in, NFC out: one document, one key
        ("  spaced  out  ", "spaced-out"),
    ],
)
def test_names_of_any_script_are_kept(stem, name):
    assert name_from_filename(stem) == name
    assert parse_key(manifest_key(name, 1)).name == name


@pytest.mark.parametrize("bad", ["§§§", "a" * 129, "é" * 101, "..", "_"])
def test_names_that_cannot_be_made_are_refused_with_the_reason(bad, tmp_path):
    with pytest.raises(InputError, match="give one with --name|invalid document name"):
        path = tmp_path / f"{bad}.md"
        path.write_text("text")
        document_and_name(path, None, None)
    with pytest.raises(InputError):
        check_name(bad if bad != "§§§" else "a/b")


def test_a_unicode_name_through_publish_an_edge_and_the_cli(model, short_text, tmp_path):
    root = tmp_path / "store"
    doc = tmp_path / "manuel d'utilisation ünï.md"
    doc.write_text(short_text)
    result = publish(doc, model=model, store=str(root), levels=LEVEL)
    assert result.name == "manuel-d-utilisation-ünï"
    edge = EdgeProcess(str(root), tmp_path / "cache", None).start()
    try:
        ctx = sdk.load_context(result.name, model=model, edges=[edge.url], quality=LEVEL)
        assert ctx.manifest.name == result.name and ctx.plan.chunk_sources[0] == edge.url
    finally:
        edge.kill()
    listed = CliRunner().invoke(cli, ["ls", "--store", str(root), "--json"])
    assert parsed("ls", listed.output)[0]["name"] == result.name
    assert open_store(str(root)).list(f"docs/{result.name}/versions/")


def test_warm_without_the_admin_token_says_refused(published, tmp_path):
    token = tmp_path / "admin.token"
    token.write_text("admin-secret\n")
    edge = EdgeProcess(str(published), tmp_path / "cache", None, "--admin-token-file",
                       str(token)).start()  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvcdn.cli.main", "warm", "guide", "--edge", edge.url,
             "--store", str(published), "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 1
        rows = parsed("warm", done.stdout)["edges"]
        assert {r["state"] for r in rows} == {"refused"}
        assert "refused the admin token" in rows[0]["errors"][0]["error"]
        ok = subprocess.run(
            [sys.executable, "-m", "kvcdn.cli.main", "warm", "guide", "--edge", edge.url,
             "--store", str(published), "--admin-token-file", str(token), "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
    finally:
        edge.kill()
