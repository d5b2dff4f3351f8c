"""An attacker who can write to the store, against readers with and without trust keys.

The store is a real folder holding documents signed by a real publisher key;
each attack edits its files as an attacker with write access (and no key)
would. A reader with the publisher's key in its trust file must refuse, or
load exactly what was published; every refusal is one line and exit code.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvcdn import sdk
from kvcdn.catalog import read_manifest
from kvcdn.document import source_digest
from kvcdn.errors import FormatError, IntegrityError, RollbackError, StoreError, TrustError
from kvcdn.keys import latest_key, manifest_key, profile_key, source_index_key
from kvcdn.manifest import pointer_bytes
from kvcdn.profile_store import publish_profile
from kvcdn.publish import publish
from kvcdn.sdk.loader import open_reader
from kvcdn.signing import TrustPolicy
from kvcdn.store import open_store
from tests.cli_json import parsed
from tests.conftest import payload, signed_store

LEVEL = "int8"


@pytest.fixture(scope="module")
def origin(model, sed_text, tmp_path_factory):
    """A store with two signed documents (the victim in two versions): the pristine copy."""
    first, second = sed_text[:2500], sed_text[:2500] + "\nA paragraph added later.\n"
    documents = [("victim", first), ("victim", second), ("donor", sed_text[4000:6500])]
    root, key, trust_file = signed_store(tmp_path_factory, model, documents)
    return root, key, trust_file, {"first": first, "second": second}


@pytest.fixture
def attacked(origin, tmp_path):
    """A fresh copy of the store for one attack."""
    root, key, trust_file, texts = origin
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    return copy, key, trust_file, texts


def _payload(path) -> dict:
    return payload(path.read_bytes())


def _cli(*args: str, env_home) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(env_home), "XDG_STATE_HOME": str(env_home)}
    return subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def _one_line(result: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], lines


def test_swapped_manifest_with_its_name_edited(attacked, model, tmp_path):
    root, key, trust_file, _ = attacked
    forged = _payload(root / manifest_key("donor", 1))
    forged["document"]["name"], forged["version"] = "victim", 2
    (root / manifest_key("victim", 2)).write_text(json.dumps(forged))
    trust = TrustPolicy([key.public])
    with pytest.raises(TrustError, match="not signed"):
        sdk.load_context("victim", model=model, store=str(root), trust=trust)
    result = _cli("inspect", "victim@2", "--store", str(root), "--trust", str(trust_file),
                  env_home=tmp_path)  # fmt: skip
    _one_line(result, 6, "is not signed")
    # Without trust keys the store is believed: the forgery loads, and says it is unsigned.
    ctx = sdk.load_context("victim@2", model=model, store=str(root), quality=LEVEL)
    assert ctx.manifest.signer is None and ctx.plan.signed_by is None


def test_forged_object_with_a_recomputed_manifest_hash(attacked, model):
    root, key, _, _ = attacked
    path = root / manifest_key("victim", 2)
    manifest = _payload(path)
    ref = manifest["chunks"][1]["objects"][LEVEL]
    donor_ref = _payload(root / manifest_key("donor", 1))["chunks"][1]["objects"][LEVEL]
    ref.update(donor_ref | {"key": ref["key"].rsplit(".", 2)[0] + f".{donor_ref['sha256']}.kvc"})
    shutil.copy(root / donor_ref["key"], root / ref["key"])
    path.write_text(json.dumps(manifest))  # unsigned now: the attacker has no key
    with pytest.raises(TrustError):
        sdk.load_context("victim@2", model=model, store=str(root), trust=TrustPolicy([key.public]))
    # Unsigned readers still catch the object: its header names another chunk. Like any
    # object that cannot be used, its chunk is recomputed from the manifest's tokens.
    ctx = sdk.load_context("victim@2", model=model, store=str(root), quality=LEVEL)
    assert ctx.plan.chunk_levels[1] == "text"
    (failed,) = ctx.plan.chunks[1].failed
    assert failed.startswith(f"{LEVEL}: damaged (") and "holds another chunk" in failed


def test_rewritten_source_index_entry(attacked, model, tmp_path):
    root, _, _, texts = attacked
    entry = root / source_index_key(model.fingerprint, source_digest(texts["second"]))
    entry.write_bytes(pointer_bytes("donor", 1))
    doc = tmp_path / "victim.md"
    doc.write_text(texts["second"])
    for trust in (None, TrustPolicy([attacked[1].public])):
        with pytest.raises(IntegrityError, match="the index entry was altered"):
            sdk.load_context(str(doc), model=model, store=str(root), trust=trust)


def test_edited_and_replayed_pointers(attacked, model, tmp_path):
    root, key, trust_file, _ = attacked
    store = open_store(str(root))
    trust = TrustPolicy([key.public])
    assert read_manifest(store, "victim", trust=trust).version == 2  # seen: 2
    latest = root / latest_key("victim")
    signed_v2 = latest.read_bytes()

    # An unsigned pointer to version 1: not believed; the listing says 2.
    latest.write_bytes(pointer_bytes("victim", 1))
    assert read_manifest(store, "victim", trust=trust).version == 2

    # A pointer whose signature no longer covers its bytes.
    raw = json.loads(signed_v2)
    raw["payload"] = base64.b64encode(pointer_bytes("victim", 1)).decode()
    latest.write_text(json.dumps(raw))
    assert read_manifest(store, "victim", trust=trust).version == 2

    # Version 2 hidden as well: nothing as new as what this reader has seen.
    (root / manifest_key("victim", 2)).unlink()
    with pytest.raises(RollbackError, match="already seen victim@2"):
        read_manifest(store, "victim", trust=trust)
    # A new reader has seen nothing: version 1, correctly signed, is what it gets.
    assert read_manifest(store, "victim", trust=TrustPolicy([key.public])).version == 1


def test_cli_remembers_the_newest_version_across_runs(attacked, tmp_path):
    root, _, trust_file, _ = attacked
    home = tmp_path / "home"
    args = ("inspect", "victim", "--store", str(root), "--trust", str(trust_file), "--json")
    first = _cli(*args, env_home=home)
    assert first.returncode == 0, first.stderr
    assert parsed("inspect", first.stdout)["version"] == 2
    assert parsed("inspect", first.stdout)["signed_by"]["trusted"] is True
    (root / manifest_key("victim", 2)).unlink()  # rolled back: only version 1 is left
    _one_line(_cli(*args, env_home=home), 6, "already seen victim@2")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["kv_layout"].update(layers=10**12), "kv_layout.layers"),
        (lambda m: m["kv_layout"].update(layers=3000), "kv_layout.layers"),
        (lambda m: m["kv_layout"].update(layers=29), "describes KV of 29 layers"),
        (lambda m: m["kv_layout"].update(dtype="complex64"), "kv_layout.dtype"),
        (lambda m: m["kv_layout"].update(dtype="float16"), "says its KV was computed in float16"),
        (
            lambda m: m["chunks"][0]["objects"]["int8"].update(key="../../../../etc/passwd"),
            "is not the key of this chunk",
        ),
    ],
)
def test_unsigned_manifests_that_would_hurt_are_refused_before_use(
    attacked, model, tmp_path, edit, message
):
    root, _, _, _ = attacked
    path = root / manifest_key("victim", 2)
    manifest = _payload(path)
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=message):
        sdk.load_context("victim@2", model=model, store=str(root), quality=LEVEL)
    result = _cli("inspect", "victim@2", "--store", str(root), env_home=tmp_path)
    if "KV" not in message:  # inspect has no model to compare the layout with
        _one_line(result, 5, message.split(".")[0])


def test_a_manifest_nested_100000_deep(attacked, tmp_path):
    root, _, _, _ = attacked
    (root / manifest_key("victim", 3)).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    _one_line(_cli("inspect", "victim@3", "--store", str(root), env_home=tmp_path), 5, "nests")


def test_planted_versions_are_never_built_on_nor_pointed_at(attacked, model):
    root, key, _, texts = attacked
    trust = TrustPolicy([key.public])
    store = open_store(str(root))
    assert read_manifest(store, "victim", trust=trust).version == 2
    (root / manifest_key("victim", 99)).write_bytes(b"planted by the attacker")
    third = texts["second"] + "\nAnd a third paragraph.\n"
    result = publish(text=third, name="victim", model=model, store=store, levels=LEVEL,
                     sign_keys=[key])  # fmt: skip
    assert result.version == 100  # above every listed key, never on top of the garbage
    manifest = read_manifest(store, "victim", trust=trust)
    assert manifest.version == 100 and manifest.source_sha256 == source_digest(third)

    # The largest version a key can name: publishing says which key blocks it, and
    # readers are not locked out of what they have.
    (root / manifest_key("victim", 999_999_999_999)).write_bytes(b"planted")
    with pytest.raises(StoreError, match="999999999999.json: no version can follow it"):
        publish(text=third + "!", name="victim", model=model, store=store, levels=LEVEL,
                sign_keys=[key])  # fmt: skip
    assert read_manifest(store, "victim", trust=trust).version == 100
    assert read_manifest(store, "victim", trust=TrustPolicy([key.public])).version == 100


def test_rollback_is_caught_whichever_path_reads_the_store(attacked):
    root, key, _, _ = attacked
    trust = TrustPolicy([key.public])
    store = open_store(str(root))
    assert read_manifest(store, "victim", trust=trust).version == 2
    (root / manifest_key("victim", 2)).unlink()
    with pytest.raises(RollbackError):
        read_manifest(store, "victim", trust=trust)
    through_edges = open_reader(str(root), edges=["http://127.0.0.1:9"], trust=trust)
    with pytest.raises(RollbackError):  # a dead edge, then the origin: the same history
        read_manifest(through_edges, "victim", trust=trust)
    with pytest.raises(RollbackError):  # the folder spelled another way
        read_manifest(open_store(str(root) + "/../store"), "victim", trust=trust)


def test_a_damaged_profile_in_the_store_is_replaced(profile, tmp_path):
    store = open_store(str(tmp_path / "store"))
    key = profile_key(profile.model_fingerprint, profile.sha256)
    (tmp_path / "store" / key).parent.mkdir(parents=True)
    (tmp_path / "store" / key).write_bytes(b"not a profile")
    ref = publish_profile(store, profile)
    assert store.get(ref.key) == profile.to_bytes()


def test_a_fresh_reader_with_trust_is_told_an_unsigned_store_is_unsigned(model, short_text,
                                                                          tmp_path):  # fmt: skip
    """Not "already seen ... rolled back": it has seen nothing."""
    from kvcdn.signing import SigningKey

    store = open_store(str(tmp_path / "store"))
    publish(text=short_text, name="plain", model=model, store=store, levels=LEVEL)
    key = SigningKey.generate("publisher")
    key.save(tmp_path / "publisher.key")
    with pytest.raises(TrustError, match="is not signed") as refused:
        read_manifest(store, "plain", trust=TrustPolicy([key.public]))
    assert not isinstance(refused.value, RollbackError)
    assert "already seen" not in str(refused.value)
    result = _cli("inspect", "plain", "--store", str(store.root), "--trust",
                  str(tmp_path / "publisher.key.pub"), env_home=tmp_path / "home")  # fmt: skip
    _one_line(result, 6, "is not signed")


def test_a_payload_altered_after_signing_is_named_so_with_and_without_trust(attacked, model,
                                                                            tmp_path):  # fmt: skip
    root, key, trust_file, _ = attacked
    path = root / manifest_key("victim", 2)
    envelope = json.loads(path.read_bytes())
    document = json.loads(base64.b64decode(envelope["payload"]))
    document["created_at"] = "1970-01-01T00:00:00+00:00"  # any edit: the signature breaks
    envelope["payload"] = base64.b64encode(json.dumps(document).encode()).decode()
    path.write_text(json.dumps(envelope))
    store = open_store(str(root))
    with pytest.raises(IntegrityError, match="altered after signing") as trusted:
        read_manifest(store, "victim", 2, trust=TrustPolicy([key.public]))
    assert f"trusted key {key.public.id}" in str(trusted.value)
    with pytest.raises(IntegrityError, match="altered after signing"):
        read_manifest(store, "victim", 2)
    result = _cli("inspect", "victim@2", "--store", str(root), "--trust", str(trust_file),
                  env_home=tmp_path)  # fmt: skip
    _one_line(result, 5, "altered after signing")


def test_a_damaged_record_of_seen_versions_is_refused_not_reset(attacked, tmp_path):
    root, _, trust_file, _ = attacked
    home = tmp_path / "home"
    args = ("inspect", "victim", "--store", str(root), "--trust", str(trust_file), "--json")
    assert _cli(*args, env_home=home).returncode == 0  # seen: victim@2, recorded
    (state,) = (home / "kvcdn" / "seen").glob("*.json")
    state.write_text('{"victim": ')  # a torn or tampered record
    _one_line(_cli(*args, env_home=home), 6, f"{state}, is damaged")
    state.unlink()
    state.symlink_to(state.with_name("elsewhere.json"))  # a link to nothing is no record either
    _one_line(_cli(*args, env_home=home), 6, f"{state}, is damaged")
    state.unlink()  # the operator starts a new record
    done = _cli(*args, env_home=home)
    assert done.returncode == 0 and parsed("inspect", done.stdout)["version"] == 2
    assert json.loads(state.read_text()) == {"victim": 2}  # recorded again


def test_a_record_of_seen_versions_is_a_file_written_where_its_link_leads(attacked, tmp_path):
    """The record a long-running reader keeps (the vLLM connector's ``trust_state``): a
    FIFO in its place is refused at once as damaged (its open() blocked the reader's
    start for good); a record that is a link (to a mounted volume's file) is written
    where the link leads, not replaced by a file of its own; taking its lock never
    empties a file; a record that cannot be written is named by ``check_state``."""
    _, _, trust_file, _ = attacked

    def policy(path: Path) -> TrustPolicy:
        return TrustPolicy.from_file(trust_file, state_path=path)

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def check(path: Path) -> None:
        try:
            policy(path).check_state()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    def check_within_20_s(path: Path) -> BaseException | None:
        outcome.clear()
        worker = threading.Thread(target=check, args=(path,), daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert outcome, f"check_state() blocked on {path}"
        return outcome[0]

    refused = check_within_20_s(fifo)
    assert isinstance(refused, TrustError) and "is not a regular file" in str(refused)
    os.mkfifo(tmp_path / "other.json.lock")  # nor the lock beside it, opened to write
    refused = check_within_20_s(tmp_path / "other.json")
    assert isinstance(refused, TrustError) and "is not a regular file" in str(refused)

    volume = tmp_path / "volume"
    volume.mkdir()
    target = volume / "seen.json"
    target.write_text('{"victim": 1}')
    lock = volume / "seen.json.lock"
    lock.write_text("not to be emptied")
    link = tmp_path / "seen.json"
    link.symlink_to(target)
    record = policy(link)
    record.check_state()
    record.saw("victim", 2)
    assert link.is_symlink() and json.loads(target.read_text()) == {"victim": 2}
    assert sorted(p.name for p in volume.iterdir()) == ["seen.json", "seen.json.lock"]
    assert lock.read_text() == "not to be emptied"
    assert policy(link).newest_seen("victim") == 2  # a new process reads it back

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(TrustError, match="cannot be written"):
        policy(blocked / "seen.json").check_state()


def test_ls_shows_the_version_the_pointer_names_not_a_planted_one(attacked, tmp_path):
    root, _, _, _ = attacked
    (root / manifest_key("victim", 999_999_999_999)).write_bytes(b"planted by the attacker")
    done = _cli("ls", "--store", str(root), "--json", env_home=tmp_path)
    assert done.returncode == 0, done.stderr
    victim = next(d for d in parsed("ls", done.stdout) if d["name"] == "victim")
    assert victim["versions"] == [1, 2, 999_999_999_999]
    assert victim["latest"] == victim["pointer"] == 2
    (root / latest_key("victim")).unlink()
    done = _cli("ls", "--store", str(root), "--json", env_home=tmp_path)
    victim = next(d for d in parsed("ls", done.stdout) if d["name"] == "victim")
    assert victim["pointer"] is None and victim["latest"] == 999_999_999_999  # the listing
