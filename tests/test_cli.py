"""The kvcdn command: real invocations, JSON output, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kvcdn.cli.main import cli
from kvcdn.codec_profile import LADDER
from tests.cli_json import commands, parsed

COMMANDS = ["publish", "refresh", "ls", "inspect", "ask", "demo", "rm", "gc"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_command_has_help(command):
    result = CliRunner().invoke(cli, [command, "--help"] if command else ["--help"])
    assert result.exit_code == 0
    assert "Usage: " in result.output
    if command:
        assert "--json" in result.output


def _json_commands(group: click.Group, prefix: str = "") -> list[str]:
    found = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _json_commands(command, f"{prefix}{name}_")
        elif any(p.name == "as_json" for p in command.params):
            found.append(f"{prefix}{name}")
    return found


def test_every_json_output_is_specified():
    """Each command that takes --json has its output in docs/cli.schema.json."""
    specified = set(commands())
    assert set(_json_commands(cli)) <= specified
    assert {"ask", "publish", "warm", "keys_new"} <= specified


def test_calibrate_json_of_a_real_profile(profile, model):
    """What `kvcdn calibrate --json` prints, for the embedded model's real profile
    (calibrating it again would cost minutes)."""
    from kvcdn.cli import reports
    from kvcdn.manifest import ObjectRef

    ref = ObjectRef("profiles/x/y.kvp", len(profile.to_bytes()), profile.sha256)
    levels = {name: spec.quality for name, spec in profile.levels.items()}
    data = parsed("calibrate", json.dumps(reports.calibrated(model.name, ref, levels,
                                                              profile.calibration)))
    assert set(data["levels"]) == set(LADDER) and data["profile"]["sha256"] == profile.sha256


def test_calibrate_stores_the_profile_and_writes_it_out(random_llama, tmp_path):
    """`kvcdn calibrate --out` writes the very profile it stores (what `make
    embedded-profile` ships), by default one whose nested ladder codes KLT
    coefficients; an --out folder that is not there is refused before the model is
    measured."""
    import hashlib

    from kvcdn.codec_profile import parse_profile
    from kvcdn.profile_store import current_profile
    from kvcdn.store import open_store
    from tests.conftest import SED_MANUAL

    runner = CliRunner()
    args = ["calibrate", "--model", str(random_llama), "--docs", str(SED_MANUAL),
            "--store", str(tmp_path / "store")]  # fmt: skip
    bad = runner.invoke(cli, [*args, "--out", str(tmp_path / "no" / "such.safetensors")])
    assert bad.exit_code == 2 and "does not exist" in bad.output, bad.output
    assert not (tmp_path / "store").exists()
    out = tmp_path / "profile.safetensors"
    made = runner.invoke(cli, [*args, "--out", str(out), "--json"])
    assert made.exit_code == 0, made.output
    data = parsed("calibrate", made.stdout)
    written = out.read_bytes()
    assert hashlib.sha256(written).hexdigest() == data["profile"]["sha256"]
    profile = parse_profile(written)
    stored, ref = current_profile(open_store(str(tmp_path / "store")), profile.model_fingerprint)
    assert ref.sha256 == stored.sha256 == profile.sha256
    assert profile.calibration["texts"] == ["sed-manual"]
    # by default (--transform) the nested ladder codes KLT coefficients, keys before RoPE
    assert profile.nested.transform is not None and profile.nested.transform.inv_freq is not None


def test_keys_json(tmp_path):
    runner = CliRunner()
    key = tmp_path / "publisher.key"
    made = runner.invoke(cli, ["keys", "new", str(key), "--name", "ci", "--json"])
    assert made.exit_code == 0, made.output
    new = parsed("keys_new", made.stdout)
    shown = parsed("keys_show", runner.invoke(cli, ["keys", "show", str(key), "--json"]).stdout)
    assert shown == [{"id": new["id"], "public_key": new["public_key"], "name": "ci"}]


def test_cli_publish_ls_inspect_ask(model, short_text, tmp_path):
    store = str(tmp_path / "store")
    doc = tmp_path / "sed intro.md"
    doc.write_text(short_text)
    runner = CliRunner()
    levels = ",".join(["fp16", *LADDER])
    out = runner.invoke(cli, ["publish", str(doc), "--store", store, "--levels", levels, "--json"])
    assert out.exit_code == 0, out.output
    published = parsed("publish", out.stdout)[0]
    assert published["name"] == "sed-intro" and published["version"] == 1

    listing = parsed("ls", runner.invoke(cli, ["ls", "--store", store, "--json"]).stdout)
    assert listing == [{"name": "sed-intro", "versions": [1], "latest": 1, "pointer": 1}]

    manifest = parsed(
        "inspect", runner.invoke(cli, ["inspect", "sed-intro@1", "--store", store, "--json"]).stdout
    )
    assert set(manifest["levels"]) == {"fp16", *LADDER, "text"}
    assert manifest["codec_profile"]["key"].startswith("profiles/")
    assert manifest["token_count"] == published["token_count"]
    table = runner.invoke(cli, ["inspect", "sed-intro", "--store", store])
    assert table.exit_code == 0 and "default" in table.output and "KL" in table.output

    asked = runner.invoke(
        cli,
        [
            "ask",
            "sed-intro",
            "What is sed?",
            "--store",
            store,
            "--level",
            "fp16",
            "--compare",
            "--max-new-tokens",
            "12",
            "--json",
        ],
    )
    assert asked.exit_code == 0, asked.output
    result = parsed("ask", asked.stdout)
    (doc,) = result["documents"]
    assert doc["ref"] == "sed-intro@1" and doc["signed_by"] is None
    assert doc["load"]["quality"] == "fp16" and result["kvcdn"]["blend"] is None
    assert set(doc["load"]["levels"]) == {"fp16"}
    assert sum(c["tokens"] for c in doc["load"]["chunks"]) == published["token_count"]
    assert result["same_answer"] is True
    assert result["kvcdn"]["answer"] == result["prefill"]["answer"] != ""
    assert result["speedup"] == pytest.approx(
        result["prefill"]["ttft_s"] / result["kvcdn"]["ttft_s"]
    )

    # the adaptive default, with a deadline: the plan is in the JSON and on the screen
    args = ["ask", "sed-intro", "What is sed?", "--store", store, "--deadline", "30"]
    adaptive = parsed("ask", runner.invoke(cli, [*args, "--json"]).stdout)
    load = adaptive["documents"][0]["load"]
    assert load["quality"] == "auto" and load["deadline_s"] == 30
    assert load["levels"] == {"fp16": len(load["chunks"])}  # the best, with slack
    assert load["predicted_ttft_s"] > 0 and adaptive["kvcdn"]["ttft_s"] < 30
    assert adaptive["prefill"] is None and adaptive["speedup"] is None
    shown = runner.invoke(cli, args)
    assert shown.exit_code == 0 and "deadline 30 s met" in shown.output
    bad = runner.invoke(cli, [*args[:-1], "0"])
    assert bad.exit_code == 2 and "--deadline" in bad.output


def test_demo_runs_on_embedded_defaults(model, tmp_path):
    result = CliRunner().invoke(cli, ["demo", "--store", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    data = parsed("demo", result.stdout)
    assert data["publish"]["name"] == "sed-manual" and data["publish"]["token_count"] > 2000
    assert data["ask"]["kvcdn"]["answer"]
    assert data["ask"]["prefill"]["ttft_s"] > 0 and data["ask"]["kvcdn"]["ttft_s"] > 0


@pytest.mark.parametrize(
    "args, message, code",
    [
        (["publish", "/no/such/doc.md"], "no such file", 2),
        (["publish", "EMPTY"], "is empty", 2),
        (["publish", "BINARY"], "binary file", 2),
        (["publish", "DOC", "--model", "gpt-17"], "unknown model 'gpt-17'", 3),
        (["publish", "DOC", "--levels", "fp16,int3"], "unknown level(s) int3", 2),
        (
            ["ls", "--store", "s3://no-such-bucket-kvcdn", "--endpoint-url", "MOTO"],
            "bucket 'no-such-bucket-kvcdn' does not exist",
            4,
        ),
        (["ls", "--store", "s3://bucket", "--endpoint-url", "http://127.0.0.1:9"], "failed", 4),
        (["inspect", "nothing-here"], "there is no store at", 4),
        # store URLs are parsed strictly: nothing lands in a folder named "s3:"
        (["ls", "--store", "s3://"], "names no bucket", 2),
        (["ls", "--store", "s3:/bucket"], "did you mean s3://bucket", 2),
        (["ls", "--store", "ftp://host/path"], "unsupported store 'ftp://host/path'", 2),
        (["ls", "--store", "s3://b/kv", "--endpoint-url", "notaurl"], "not an endpoint URL", 2),
        # names and questions are checked before the model loads (a model that cannot
        # load would otherwise be the error, exit 3)
        (["publish", "DOC", "--name", "bad/name", "--model", "/no/model"], "invalid document", 2),
        (["ask", "bad/name", "Why?", "--model", "/no/model"], "invalid document name", 2),
        (["ask", "doc", "  ", "--model", "/no/model"], "the question is empty", 2),
        (["publish", "ODD", "--model", "/no/model"], "cannot make a document name", 2),
        (["publish", "DOC", "--sign-key", "/no/key", "--model", "/no/model"], "signing key", 2),
        (["ask", "doc", "Why?", "--trust", "/no/trust"], "cannot read the trust file", 2),
        (["inspect", "doc", "--trust", "/dev/zero"], "larger than a trust file can be", 2),
        (["ask", "a" * 300, "Why?"], "invalid document name", 2),
        (["inspect", "nothing-here", "--store", "DIR"], "no document named 'nothing-here'", 4),
        (["inspect", "bad/name"], "invalid document name", 2),
        (["rm", "nothing-here", "--store", "DIR"], "no document named 'nothing-here'", 4),
        (["rm", "doc@0", "--store", "DIR"], "invalid version", 2),
        (["gc", "--grace", "soon", "--store", "DIR"], "is not a duration", 2),
        (["ls", "--after", "bad/name", "--store", "DIR"], "invalid document name", 2),
        (["publish", "DOC", "--ray=127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1", 2),
        (["publish", "DIR/none*.md"], "no file matches", 2),
    ],
)
def test_user_mistakes_get_one_line_and_an_exit_code(args, message, code, tmp_path, moto_endpoint):
    (tmp_path / "empty.md").write_text("")
    (tmp_path / "blob").write_bytes(b"\0\1\2")
    (tmp_path / "doc.md").write_text("A short document.")
    (tmp_path / "§§§.md").write_text("A document whose file name makes no name.")
    subst = {
        "EMPTY": str(tmp_path / "empty.md"),
        "BINARY": str(tmp_path / "blob"),
        "DOC": str(tmp_path / "doc.md"),
        "MOTO": moto_endpoint,
        "DIR": str(tmp_path),
        "ODD": str(tmp_path / "§§§.md"),
    }
    result = run(*[subst.get(a, a) for a in args], env={"KVCDN_STORE": str(tmp_path / "store")})
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]


@pytest.mark.parametrize(
    "option, value",
    [("--max-bytes", "1e400"), ("--rate-limit", "1e999M"), ("--throttle-trace", "BINARY"),
     ("--pointer-ttl", "-1")],
)
def test_edge_options_out_of_range_are_usage_errors(option, value, tmp_path):
    (tmp_path / "blob").write_bytes(b"\xff\xfe\0\1")
    value = str(tmp_path / "blob") if value == "BINARY" else value
    result = run("edge", "serve", "--origin", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
                 option, value)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "Error: Invalid value for" in result.stderr


def test_edge_serve_defaults_are_the_edges_own():
    """The CLI states some of the edge's defaults without importing it (start-up time):
    they must not drift apart."""
    from kvcdn.edge.fill import MAX_STALE_S, POINTER_TTL_S

    serve = cli.commands["edge"].commands["serve"]
    defaults = {p.name: p.default for p in serve.params}
    assert defaults["pointer_ttl"] == POINTER_TTL_S
    assert defaults["max_stale"] == MAX_STALE_S


def test_cli_never_loads_kv_of_a_corrupted_object(model, short_text, tmp_path):
    """The damaged object is named, and its chunk loaded another way (docs/streaming.md)."""
    store = tmp_path / "store"
    runner = CliRunner()
    doc = tmp_path / "d.md"
    doc.write_text(short_text)
    assert runner.invoke(cli, ["publish", str(doc), "--store", str(store)]).exit_code == 0
    victim = sorted(store.glob("objects/**/nearlossless-*.kvc"))[0]  # what auto loads
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    result = runner.invoke(cli, ["ask", "d", "What is sed?", "--store", str(store), "--json"])
    assert result.exit_code == 0, result.output
    chunks = parsed("ask", result.stdout)["documents"][0]["load"]["chunks"]
    (hit,) = [c for c in chunks if c["failed"]]
    assert hit["level"] != "nearlossless"  # another level, or recomputed
    assert hit["failed"] == ["nearlossless: damaged (it does not match the size and sha256 its "
                             "manifest records (corrupted in the store or in transit))"]


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "kvcdn")
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "0.1.0" in result.stdout


def test_publish_with_a_device_map_publishes_what_one_device_does(random_llama, short_text,
                                                                  tmp_path):  # fmt: skip
    """``--device-map auto`` loads the model through accelerate's placement (here, with no
    GPU, every layer on the CPU) and reads its KV layer by layer: the same objects as
    ``--device cpu``, byte for byte. Mistakes are named, not raised."""
    from kvcdn import catalog
    from kvcdn.store import open_store

    doc = tmp_path / "doc.md"
    doc.write_text(short_text)
    runner = CliRunner()
    keys = []
    for placement in (["--device-map", "auto"], ["--device", "cpu"]):
        store = str(tmp_path / placement[1])
        out = runner.invoke(cli, ["publish", str(doc), "--model", str(random_llama), "--store",
                                  store, "--levels", "fp16", "--json", *placement])  # fmt: skip
        assert out.exit_code == 0, out.output
        manifest = catalog.read_manifest(open_store(store, create=False), "doc")
        keys.append([c.objects["fp16"].key for c in manifest.chunks])
    assert keys[0] == keys[1]
    out = runner.invoke(cli, ["publish", str(doc), "--device-map", "auto", "--device", "cpu",
                              "--store", str(tmp_path / "x")])  # fmt: skip
    assert out.exit_code == 2 and "--device-map places the model" in out.output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--dtype", "float32"], "--dtype sets what a vLLM engine computes in: add --engine vllm"),
        (["--tensor-parallel-size", "2"], "split a vLLM engine: add --engine vllm"),
        (["--engine", "vllm", "--dtype", "fp8"], "'fp8' is not one of"),
        (["--engine", "vllm", "--ray"], "drop --engine vllm"),
    ],
)
def test_engine_options_without_their_engine_are_named(options, message, tmp_path):
    """Options of a vLLM publish given without ``--engine vllm`` (or with what it cannot
    take) are named before the model loads or anything is written."""
    doc = tmp_path / "doc.md"
    doc.write_text("a document")
    store = tmp_path / "store"
    out = CliRunner().invoke(cli, ["publish", str(doc), "--store", str(store), *options])
    assert out.exit_code == 2, out.output
    assert message in " ".join(out.output.split()), out.output
    assert "Traceback" not in out.output and not store.exists()
