"""Cached model folders: made once, reused by other processes, checked before every
load, rebuilt (never loaded) when damaged; the same logits and fingerprint as the GGUF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvcdn import model_cache
from kvcdn.cli.main import cli
from kvcdn.models import LoadedModel, _file_sha256, _from_pretrained, resolve_model
from tests.cli_json import parsed

# A fresh process that loads the embedded model and says what it did.
_CHILD = r"""
import json, time
from kvcdn.models import load_model
t = time.perf_counter()
m = load_model("smollm2-135m", "cpu")
print(json.dumps({"materialise_s": m.materialise_s, "load_s": time.perf_counter() - t,
                  "fingerprint": m.fingerprint}))
"""


def _start(cache_home: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if cache_home is not None:
        env["XDG_CACHE_HOME"] = str(cache_home)
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


def _result(child: subprocess.Popen) -> dict:
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _session_folder(model: LoadedModel) -> Path:
    """The folder the session's model was loaded from (the user's real cache)."""
    gguf = Path(model.source.directory) / model.source.gguf_file
    folder = model_cache.models_dir() / model_cache.folder_key(model.name, _file_sha256(gguf))
    assert model_cache.check_folder(folder, _file_sha256(gguf))
    return folder


def _stamps(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {
        p.name: (p.stat().st_mtime_ns, p.stat().st_ino, p.stat().st_size)
        for p in folder.iterdir()
        if not p.name.startswith(".")
    }


def test_the_folder_is_made_once_and_reused_by_another_process(model):
    folder = _session_folder(model)
    before = _stamps(folder)
    child = _result(_start())
    assert child["materialise_s"] == 0.0
    assert child["fingerprint"] == model.fingerprint
    assert _stamps(folder) == before  # read, not rewritten

    # a standard Hugging Face folder, which transformers (and vLLM) open on their own
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(folder).architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.get_vocab() == model.tokenizer.get_vocab()
    assert tokenizer.chat_template == model.tokenizer.chat_template


def test_the_folder_gives_the_logits_and_fingerprint_of_the_gguf(model, sed_text):
    """The session's model reads the folder; this loads the GGUF file itself."""
    source = resolve_model("smollm2-135m")
    tokenizer, gguf_model = _from_pretrained(source, source.directory, source.gguf_file,
                                             torch.float32)  # fmt: skip
    gguf_model.eval()
    from_gguf = LoadedModel(source, gguf_model, tokenizer, "cpu")
    # manifests published by a GGUF load keep loading with the folder
    assert from_gguf.fingerprint == model.fingerprint
    ids = model.document_ids(sed_text)[:1024]
    assert from_gguf.document_ids(sed_text)[:1024] == ids
    with torch.inference_mode():
        want = gguf_model(torch.tensor([ids])).logits
        got = model.model(torch.tensor([ids])).logits
    assert torch.equal(got, want)


def test_identity_without_weights_is_the_loaded_models(model, tmp_path):
    """What a serving engine checks KV against, from config, tokenizer and weight files,
    named by the alias or by the materialised folder (as vLLM is given it)."""
    from kvcdn.models import model_folder, model_identity

    folder = model_folder("smollm2-135m")
    done = CliRunner().invoke(cli, ["models", "path", "smollm2-135m"])
    assert done.exit_code == 0 and done.stdout.strip() == folder
    for name in ("smollm2-135m", folder):
        identity = model_identity(name)
        assert identity.name == "smollm2-135m"
        assert identity.fingerprint == model.fingerprint
        assert identity.layout.layers == model.layout.layers
        assert (identity.layout.kv_heads, identity.layout.head_dim) == (3, 64)
        assert identity.vocab_size == model.vocab_size
        assert identity.context_window == model.context_window
    # a copy of the folder that differs is another model, not the embedded one
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    with open(copy / "config.json", "a") as f:
        f.write("\n")
    assert model_identity(str(copy)).fingerprint != model.fingerprint


def test_damaged_folders_are_rebuilt_never_loaded(model, tmp_path):
    folder = _session_folder(model)
    gguf_sha = _file_sha256(Path(model.source.directory) / model.source.gguf_file)
    home = tmp_path / "cache"
    copy = home / "kvcdn" / "models" / folder.name
    shutil.copytree(folder, copy)
    weights = copy / "model.safetensors"

    # Truncated, and two processes loading at once: one rebuilds, the other waits
    # for it and loads the rebuilt folder; one good folder, nothing left over.
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    first, second = _start(home), _start(home)
    results = [_result(first), _result(second)]
    assert sorted(r["materialise_s"] > 0 for r in results) == [False, True]
    assert {r["fingerprint"] for r in results} == {model.fingerprint}
    assert model_cache.check_folder(copy, gguf_sha)
    assert sorted(p.name for p in copy.parent.iterdir() if not p.name.startswith(".lock")) == [
        folder.name
    ]

    # Tampered without a change of size: the check hashes the file again and fails
    # (and passes once the byte is put back: the flip is what it found).
    def flip() -> None:
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))

    flip()
    assert not model_cache.check_folder(copy, gguf_sha)
    flip()
    assert model_cache.check_folder(copy, gguf_sha)

    # A file added beside the recorded ones (transformers would read an index or a
    # second weights file): refused as well. (A load rebuilds any folder the check
    # refuses, as it did the truncated one above; a rebuild is ~20 s of materialising.)
    (copy / "model.safetensors.index.json").write_text("{}")
    assert not model_cache.check_folder(copy, gguf_sha)


def test_kvcdn_models_lists_and_removes(model, tmp_path, monkeypatch):
    folder = _session_folder(model)
    listed = parsed("models", CliRunner().invoke(cli, ["models", "--json"]).stdout)
    (entry,) = [e for e in listed if e["folder"] == folder.name]
    assert entry["complete"] and entry["model"] == "smollm2-135m" and entry["bytes"] > 5e8

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    copy = tmp_path / "kvcdn" / "models" / folder.name
    shutil.copytree(folder, copy)
    runner = CliRunner()
    assert "no such" not in runner.invoke(cli, ["models"]).output
    removed = runner.invoke(cli, ["models", "rm", folder.name, "--json"])
    assert removed.exit_code == 0, removed.output
    assert parsed("models_rm", removed.stdout)[0]["folder"] == folder.name
    assert not copy.exists()
    missing = runner.invoke(cli, ["models", "rm", "nope-0123456789abcdef"])
    assert missing.exit_code == 2 and "no cached model folder" in missing.output
    assert runner.invoke(cli, ["models", "rm"]).exit_code == 2


@pytest.mark.parametrize("what", ["import", "client"])
def test_kvcdn_leaves_the_host_environment_alone(what, tmp_path):
    code = (
        "import os, json; before = dict(os.environ)\n"
        "import kvcdn, kvcdn.models, kvcdn.store, kvcdn.codec, kvcdn.publish\n"
        "from kvcdn import sdk\n"
        "import kvcdn.edge.server, kvcdn.cli.app\n"
    )
    if what == "client":
        code += f"c = sdk.Client(store={str(tmp_path)!r}); c.model()\n"
    code += "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
