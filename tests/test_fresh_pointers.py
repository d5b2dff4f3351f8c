"""Fresh pointers: a signed latest pointer carries an expiry, readers with a trust file
refuse it once past, `kvcdn refresh` renews it, and edges never serve one stale past
it. Real stores (folders), real signatures, the real CLI and real edge processes;
time passes for real (windows of seconds) or a pointer is signed already expired."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from kvcdn import sdk
from kvcdn.catalog import find_by_prefix, read_manifest
from kvcdn.errors import (
    FormatError,
    FreshnessError,
    IntegrityError,
    PointerExpired,
    RollbackError,
)
from kvcdn.keys import latest_key, manifest_key, prefix_index_key
from kvcdn.manifest import format_expiry, open_pointer, parse_expiry, pointer_bytes
from kvcdn.publish import publish, refresh
from kvcdn.sdk.edges import EdgeStore
from kvcdn.signing import POINTER_TYPE, SigningKey, TrustPolicy, seal
from kvcdn.store import LocalStore, open_store
from tests.cli_json import parsed
from tests.conftest import payload, signed_store
from tests.edge_helpers import EdgeProcess, get

LEVEL = "int8"  # no codec profile needed: nothing here calibrates
WEEK = 7 * 86400


@pytest.fixture(scope="module")
def pristine(model, sed_text, tmp_path_factory):
    """A store folder with one signed document, "guide" (one version, pointer valid
    for the default week), its publisher's key and the key's .pub as a trust file."""
    root, key, trust_file = signed_store(tmp_path_factory, model, [("guide", sed_text[:2000])],
                                         levels=LEVEL)  # fmt: skip
    return root, key, trust_file


@pytest.fixture
def signed(pristine, tmp_path):
    """A copy of the pristine store for one test: (root, key, trust file, key file)."""
    root, key, trust_file = pristine
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    return copy, key, trust_file, trust_file.with_suffix("")


def kvcdn(*args: str, home: Path) -> subprocess.CompletedProcess:
    """The real command; ``home`` holds its record of seen versions (one per test)."""
    return subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "XDG_STATE_HOME": str(home)},
    )  # fmt: skip


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def write_pointer(root: Path, key: SigningKey, version: int, expires: int | None) -> None:
    """A pointer to ``guide@version`` signed by the publisher's own key, as a store
    replaying an old one would serve it (or as kvcdn wrote them before expiries)."""
    data = seal(pointer_bytes("guide", version, expires), POINTER_TYPE, [key])
    (root / latest_key("guide")).write_bytes(data)


def pointer_of(root: Path) -> dict:
    return payload((root / latest_key("guide")).read_bytes())


# ---- the format ---------------------------------------------------------------------


def test_a_publish_signs_an_expiry_a_week_ahead_inside_the_payload(signed, tmp_path):
    root, key, trust_file, _ = signed
    raw = pointer_of(root)
    assert set(raw) == {"name", "version", "manifest", "expires"}
    expires = parse_expiry(raw["expires"], "the pointer")
    assert abs(expires - (time.time() + WEEK)) < 600
    assert raw["expires"] == format_expiry(expires)  # one spelling: 2026-01-31T12:00:00Z

    # A pointer within its window loads, through the CLI with the trust file.
    shown = kvcdn("inspect", "guide", "--store", str(root), "--trust", str(trust_file), "--json",
                  home=tmp_path)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert parsed("inspect", shown.stdout)["version"] == 1

    # The expiry is signed: pushed a year ahead by someone without the key, it breaks
    # the signature (exit 5: altered after signing), whether or not the reader trusts.
    envelope = json.loads((root / latest_key("guide")).read_bytes())
    raw["expires"] = format_expiry(time.time() + 365 * 86400)
    envelope["payload"] = base64.b64encode(json.dumps(raw).encode()).decode()
    (root / latest_key("guide")).write_text(json.dumps(envelope))
    with pytest.raises(IntegrityError, match="altered after signing"):
        open_pointer((root / latest_key("guide")).read_bytes(), what="pointer",
                     trust=TrustPolicy([key.public]))  # fmt: skip
    plain = kvcdn("inspect", "guide", "--store", str(root), home=tmp_path)
    assert plain.returncode == 5 and "altered after signing" in one_error_line(plain)


HOSTILE_EXPIRES = [
    1767225600,  # Unix seconds: not the format
    1.7e9,
    True,
    None,
    "",
    [],
    {"at": "2026-01-31T12:00:00Z"},
    "2026-13-01T00:00:00Z",  # no 13th month
    "2026-02-30T00:00:00Z",
    "2026-01-01T24:00:00Z",
    "2026-01-01T00:00:60Z",  # leap seconds are not written
    "2026-01-01 00:00:00Z",
    "2026-01-01T00:00:00+00:00",  # offsets, fractions and lower case: other spellings
    "2026-01-01T00:00:00.5Z",
    "2026-01-01t00:00:00z",
    "2026-01-01T00:00:00Z\n",
    "0000-01-01T00:00:00Z",
    "1969-12-31T23:59:59Z",
    "\uff12\uff10\uff12\uff16-01-01T00:00:00Z",  # full-width digits
    "9" * 4000,
]


@pytest.mark.parametrize("value", HOSTILE_EXPIRES, ids=lambda v: repr(v)[:30])
def test_hostile_expiry_fields_are_format_errors(value):
    """Signed by the trusted key itself, so that only the field's parsing can refuse."""
    key = SigningKey.generate("publisher")
    raw = {"name": "guide", "version": 1, "manifest": "docs/guide/versions/000001.json",
           "expires": value}  # fmt: skip
    data = seal(json.dumps(raw).encode(), POINTER_TYPE, [key])
    for trust in (None, TrustPolicy([key.public])):
        with pytest.raises(FormatError, match="expires"):
            open_pointer(data, what="docs/guide/latest.json", trust=trust)


def test_a_pointer_with_unknown_fields_is_refused_and_old_ones_still_read():
    key = SigningKey.generate("publisher")
    trust = TrustPolicy([key.public])
    odd = {"name": "guide", "version": 1, "manifest": "docs/guide/versions/000001.json",
           "expiry": "2030-01-01T00:00:00Z"}  # fmt: skip
    with pytest.raises(FormatError, match="not a valid version pointer"):
        open_pointer(seal(json.dumps(odd).encode(), POINTER_TYPE, [key]), what="p", trust=trust)
    old = open_pointer(seal(pointer_bytes("guide", 1), POINTER_TYPE, [key]), what="p", trust=trust)
    assert old.version == 1 and old.expires is None
    assert open_pointer(pointer_bytes("guide", 3), what="p").expires is None  # unsigned, plain


# ---- readers --------------------------------------------------------------------------


def test_an_expired_pointer_is_refused_with_exit_6_and_refresh_renews_it(signed, tmp_path):
    root, key, trust_file, key_file = signed
    expired = math.floor(time.time()) - 3600  # replayed an hour after its expiry
    write_pointer(root, key, 1, expired)
    trusting = ("--store", str(root), "--trust", str(trust_file))

    refused = kvcdn("inspect", "guide", *trusting, home=tmp_path)
    assert refused.returncode == 6, refused.stderr
    line = one_error_line(refused)
    assert "guide's latest pointer (naming guide@1) expired at " + format_expiry(expired) in line
    assert "it is now 20" in line and "kvcdn refresh guide" in line
    # an explicit version is never a matter of freshness
    assert kvcdn("inspect", "guide@1", *trusting, home=tmp_path).returncode == 0
    # a reader without a trust file follows it, and says so
    plain = kvcdn("inspect", "guide", "--store", str(root), "--json", home=tmp_path)
    assert plain.returncode == 0 and parsed("inspect", plain.stdout)["version"] == 1
    assert "expired at " + format_expiry(expired) in plain.stderr
    # the library raises the typed error, a TrustError
    with pytest.raises(PointerExpired, match="expired at"):
        read_manifest(open_store(str(root)), "guide", trust=TrustPolicy([key.public]))

    # a refresh does not renew an expired pointer on its own: a store replaying an old
    # one (and hiding the newer versions) looks the same
    held = kvcdn("refresh", "guide", "--store", str(root), "--sign-key", str(key_file),
                 home=tmp_path)  # fmt: skip
    assert held.returncode == 6, held.stderr
    assert "--renew-expired" in one_error_line(held)
    assert pointer_of(root)["expires"] == format_expiry(expired)  # untouched
    renewed = kvcdn("refresh", "guide", "--store", str(root), "--sign-key", str(key_file),
                    "--renew-expired", "--json", home=tmp_path)  # fmt: skip
    assert renewed.returncode == 0, renewed.stderr
    report = parsed("refresh", renewed.stdout)
    assert report["failed"] == []
    (done,) = report["refreshed"]
    assert done["name"] == "guide" and done["version"] == done["previous_version"] == 1
    assert done["signed_by"] == [key.public.id]
    assert abs(parse_expiry(done["expires"], "expires") - (time.time() + WEEK)) < 600
    assert pointer_of(root)["expires"] == done["expires"]

    again = kvcdn("inspect", "guide", *trusting, "--json", home=tmp_path)
    assert again.returncode == 0, again.stderr
    assert parsed("inspect", again.stdout)["version"] == 1  # the same version as before


def test_check_with_trust_reports_what_readers_with_it_would_refuse(signed, tmp_path):
    root, key, trust_file, key_file = signed
    expired = math.floor(time.time()) - 3600
    write_pointer(root, key, 1, expired)
    checking = ("check", "--store", str(root), "--json")

    found = kvcdn(*checking, "--trust", str(trust_file), home=tmp_path)
    assert found.returncode == 6, found.stderr  # trust: what readers with it exit with
    report = parsed("check", found.stdout)
    (problem,) = report["problems"]
    assert problem["key"] == latest_key("guide") and problem["kind"] == "expired"
    assert "expired at " + format_expiry(expired) in problem["detail"]
    assert "kvcdn refresh guide" in problem["detail"]
    assert not report["ok"]
    # without trust, readers follow it: nothing to report
    assert kvcdn(*checking, home=tmp_path).returncode == 0
    # a pointer without expiry fails only a check that requires one
    write_pointer(root, key, 1, None)
    assert kvcdn(*checking, "--trust", str(trust_file), home=tmp_path).returncode == 0
    strict = kvcdn(*checking, "--trust", str(trust_file), "--require-expiry", home=tmp_path)
    assert strict.returncode == 6
    assert [p["kind"] for p in parsed("check", strict.stdout)["problems"]] == ["expired"]
    # renewed, it passes
    renewed = kvcdn("refresh", "guide", "--store", str(root), "--sign-key", str(key_file),
                    home=tmp_path)  # fmt: skip
    assert renewed.returncode == 0, renewed.stderr
    final = kvcdn(*checking, "--trust", str(trust_file), "--require-expiry", home=tmp_path)
    assert final.returncode == 0, final.stdout


def test_a_short_window_expires_for_real_and_a_republish_renews_it(signed, model, sed_text):
    root, key, _, _ = signed
    store = open_store(str(root))
    exact = TrustPolicy([key.public], clock_skew_s=0)  # no allowance: the window is seconds
    again = publish(text=sed_text[:2000], name="guide", model=model, store=store, levels=LEVEL,
                    sign_keys=[key], pointer_valid_for=2)  # fmt: skip
    assert again.unchanged  # nothing new to publish, and still the pointer is renewed
    expires = parse_expiry(pointer_of(root)["expires"], "expires")
    assert expires - time.time() <= 3
    assert read_manifest(store, "guide", trust=exact).version == 1  # within its window
    time.sleep(max(0.0, expires - time.time()) + 1.1)
    with pytest.raises(PointerExpired, match="guide's latest pointer"):
        read_manifest(store, "guide", trust=exact)
    # the default allowance for clock skew (300 s) still takes it
    assert read_manifest(store, "guide", trust=TrustPolicy([key.public])).version == 1

    result = refresh("guide", store=store, sign_keys=[key], pointer_valid_for=3600)
    assert (result.version, result.previous_version) == (1, 1)
    assert read_manifest(store, "guide", trust=exact).version == 1


def test_a_policy_that_requires_expiry_refuses_pointers_without_one(signed, tmp_path):
    root, key, trust_file, _ = signed
    write_pointer(root, key, 1, None)  # signed as kvcdn signed pointers before expiries
    trusting = ("inspect", "guide", "--store", str(root), "--trust", str(trust_file))

    # the default keeps stores signed before expiries readable
    assert kvcdn(*trusting, home=tmp_path).returncode == 0
    strict = kvcdn(*trusting, "--require-expiry", home=tmp_path)
    assert strict.returncode == 6
    assert "carries no expiry" in one_error_line(strict)
    # ... and a store that hides the pointer gets nothing from the listing either
    (root / latest_key("guide")).unlink()
    hidden = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", *trusting],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path), "KVCDN_REQUIRE_EXPIRY": "1"},
    )  # fmt: skip
    assert hidden.returncode == 6 and "has no latest pointer" in one_error_line(hidden)
    with pytest.raises(FreshnessError, match="has no latest pointer"):
        read_manifest(open_store(str(root)), "guide",
                      trust=TrustPolicy([key.public], require_expiry=True))  # fmt: skip
    # a fresh pointer satisfies it
    write_pointer(root, key, 1, math.ceil(time.time()) + 600)
    assert kvcdn(*trusting, "--require-expiry", home=tmp_path).returncode == 0
    # requiring expiry without a trust file is a mistake, said as one
    alone = kvcdn("inspect", "guide", "--store", str(root), "--require-expiry", home=tmp_path)
    assert alone.returncode == 2 and "needs --trust" in alone.stderr


@pytest.mark.parametrize("strict", [False, True])
def test_a_hostile_signed_expiry_is_never_a_traceback(signed, tmp_path, strict):
    root, key, trust_file, _ = signed
    raw = {"name": "guide", "version": 1, "manifest": "docs/guide/versions/000001.json",
           "expires": "2026-02-30T00:00:00Z"}  # fmt: skip
    (root / latest_key("guide")).write_bytes(seal(json.dumps(raw).encode(), POINTER_TYPE, [key]))
    plain = kvcdn("inspect", "guide", "--store", str(root), home=tmp_path)
    assert plain.returncode == 5 and "is not a real date" in one_error_line(plain)
    args = ["inspect", "guide", "--store", str(root), "--trust", str(trust_file)]
    trusting = kvcdn(*args, *(["--require-expiry"] if strict else []), home=tmp_path)
    if strict:  # no pointer it can believe: refused
        assert trusting.returncode == 6 and "is not a real date" in one_error_line(trusting)
    else:  # a damaged pointer is passed over, as before: the newest verified version
        assert trusting.returncode == 0 and "is not a real date" in trusting.stderr


# ---- kvcdn refresh ------------------------------------------------------------------


class PublishBeforePointer(LocalStore):
    """A real folder store that, just before the first write of a latest pointer made
    through it, runs ``before`` to completion: the worst moment for a publish to
    land, when a refresh has read the pointer and not yet written its renewal."""

    def __init__(self, root: Path, before) -> None:
        super().__init__(str(root), fsspec.filesystem("file"), str(root))
        self.before = before

    def put(self, key: str, data: bytes) -> None:
        if key == latest_key("guide") and self.before is not None:
            before, self.before = self.before, None
            before()
        super().put(key, data)


def test_a_publish_racing_a_refresh_is_not_lost(signed, model, sed_text):
    root, key, _, _ = signed
    published = []

    def a_publish_lands() -> None:  # on the store itself, not through the racing one
        done = publish(text=sed_text[:2400], name="guide", model=model, store=str(root),
                       levels=LEVEL, sign_keys=[key])  # fmt: skip
        published.append(done)
        assert pointer_of(root)["version"] == 2

    racing = PublishBeforePointer(root, a_publish_lands)
    result = refresh("guide", store=racing, sign_keys=[key], pointer_valid_for=3600)
    assert published and published[0].version == 2
    # the refresh read version 1, and left the pointer at the publish's version 2
    assert (result.previous_version, result.version) == (1, 2)
    assert pointer_of(root)["version"] == 2
    trust = TrustPolicy([key.public], clock_skew_s=0)
    assert read_manifest(open_store(str(root)), "guide", trust=trust).version == 2

    # and the other way round: a refresh that lands while a publish is writing its pointer
    def a_refresh_lands() -> None:
        refresh("guide", store=open_store(str(root)), sign_keys=[key], pointer_valid_for=60)

    racing = PublishBeforePointer(root, a_refresh_lands)
    third = publish(text=sed_text[:2800], name="guide", model=model, store=racing,
                    levels=LEVEL, sign_keys=[key])  # fmt: skip
    assert third.version == 3 and pointer_of(root)["version"] == 3


def test_refresh_mistakes_and_all(signed, model, short_text, tmp_path):
    root, key, trust_file, key_file = signed
    store = ("--store", str(root))
    publish(text=short_text, name="plain", model=model, store=str(root), levels=LEVEL)

    none = kvcdn("refresh", *store, "--sign-key", str(key_file), home=tmp_path)
    assert none.returncode == 2 and "or give --all" in none.stderr
    unsigned = kvcdn("refresh", "guide", *store, home=tmp_path)
    assert unsigned.returncode == 2 and "--sign-key" in unsigned.stderr
    foreign = kvcdn("refresh", "plain", *store, "--sign-key", str(key_file), home=tmp_path)
    assert foreign.returncode == 6 and "is not signed" in one_error_line(foreign)
    missing = kvcdn("refresh", "nothing", *store, "--sign-key", str(key_file), home=tmp_path)
    assert missing.returncode == 4 and "no document named 'nothing'" in one_error_line(missing)
    for window, message in (("soon", "is not a duration"), ("0s", "from 1 s to 3650 days"),
                            ("3651d", "from 1 s to 3650 days")):  # fmt: skip
        bad = kvcdn("refresh", "guide", *store, "--sign-key", str(key_file),
                    "--pointer-valid-for", window, home=tmp_path)  # fmt: skip
        assert bad.returncode == 2 and message in one_error_line(bad), window

    # --all: what can be renewed is, the rest is reported, and the exit code says so
    before = pointer_of(root)["expires"]
    every = kvcdn("refresh", "--all", *store, "--sign-key", str(key_file), "--json",
                  "--pointer-valid-for", "2h", home=tmp_path)  # fmt: skip
    assert every.returncode == 6, every.stderr
    report = parsed("refresh", every.stdout)
    assert [r["name"] for r in report["refreshed"]] == ["guide"]
    assert [(f["name"], f["exit_code"]) for f in report["failed"]] == [("plain", 6)]
    after = pointer_of(root)["expires"]
    assert after != before and after == report["refreshed"][0]["expires"]
    assert abs(parse_expiry(after, "expires") - (time.time() + 7200)) < 600


def test_publish_takes_a_window_and_refuses_a_bad_one(signed, short_text, tmp_path):
    root, key, _, key_file = signed
    doc = tmp_path / "note.md"
    doc.write_text(short_text)
    args = ("publish", str(doc), "--store", str(root), "--levels", LEVEL)
    unsigned = kvcdn(*args, "--pointer-valid-for", "1h", home=tmp_path)
    assert unsigned.returncode == 2 and "add --sign-key" in unsigned.stderr
    bad = kvcdn(*args, "--sign-key", str(key_file), "--pointer-valid-for", "-3d", home=tmp_path)
    assert bad.returncode == 2 and "is not a duration" in one_error_line(bad)

    started = time.time()
    ok = kvcdn(*args, "--sign-key", str(key_file), "--pointer-valid-for", "90m", "--json",
               home=tmp_path)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    raw = payload((root / latest_key("note")).read_bytes())
    expires = parse_expiry(raw["expires"], "expires")
    assert started + 5400 <= expires <= time.time() + 5400 + 1


def test_an_index_entry_is_held_to_what_a_latest_pointer_is(signed, model, sed_text):
    """The prefix index (how a serving engine finds the document a prompt begins with)
    is unsigned: an entry rewritten to name an old version is refused by a reader that
    has seen a newer one, and under require_expiry unless the document's signed pointer
    is current. Before, the entry's version was read as an explicit one, past both."""
    root, key, _, _ = signed
    publish(text=sed_text[:2000] + "\nA second edition.", name="guide", model=model,
            store=str(root), levels=LEVEL, sign_keys=[key])  # fmt: skip
    store = open_store(str(root))
    trust = TrustPolicy([key.public])
    latest = read_manifest(store, "guide", trust=trust)
    fingerprint, first = latest.model_fingerprint, latest.chunks[0].hash
    assert latest.version == 2 and find_by_prefix(store, fingerprint, first, trust=trust) == latest
    (root / prefix_index_key(fingerprint, first)).write_bytes(pointer_bytes("guide", 1))
    with pytest.raises(RollbackError, match="already seen guide@2"):
        find_by_prefix(store, fingerprint, first, trust=trust)
    # a reader that has seen no version takes the signed version the entry names (its
    # tokens are the prompt's), unless it requires a current pointer and the store
    # replays an expired one beside the entry, or hides the pointer
    assert find_by_prefix(store, fingerprint, first, trust=TrustPolicy([key.public])).version == 1
    strict = TrustPolicy([key.public], require_expiry=True)
    assert find_by_prefix(store, fingerprint, first, trust=strict).version == 1  # current
    write_pointer(root, key, 1, math.floor(time.time()) - 3600)
    with pytest.raises(PointerExpired, match="guide's latest pointer"):
        find_by_prefix(store, fingerprint, first, trust=strict)
    (root / latest_key("guide")).unlink()
    with pytest.raises(FreshnessError, match="guide has no latest pointer"):
        find_by_prefix(store, fingerprint, first, trust=strict)
    assert find_by_prefix(store, fingerprint, first).version == 1  # no trust: followed


# ---- edges ----------------------------------------------------------------------------


@pytest.mark.parametrize("with_trust", [True, False], ids=["trust", "no-trust"])
def test_an_edge_does_not_reuse_a_pointer_past_its_expiry(signed, tmp_path, with_trust):
    """A pointer that expires while an edge holds it is not reused for the rest of
    ``--pointer-ttl``: it is fetched again, and with the origin down refused (before,
    it was served as a plain 200 for up to a whole --pointer-ttl past its expiry)."""
    root, key, trust_file, _ = signed
    expires = math.floor(time.time()) + 4
    write_pointer(root, key, 1, expires)
    extra = ("--pointer-ttl", "60", *(("--trust", str(trust_file)) if with_trust else ()))
    node = EdgeProcess(str(root), tmp_path / "cache", None, *extra).start()
    gone = root.with_name("gone")
    try:
        url = f"{node.url}/{latest_key('guide')}"
        status, headers, body = get(url)
        assert status == 200 and payload(body)["expires"] == format_expiry(expires)
        # a cache below the edge keeps it no longer than its expiry either (not 60 s)
        assert re.fullmatch(r"public, max-age=[0-4], must-revalidate", headers["Cache-Control"])
        status, headers, _ = get(url)
        assert status == 200 and node.metrics()["kvcdn_edge_hits_total"] >= 1  # reused
        assert re.fullmatch(r"public, max-age=[0-4], must-revalidate", headers["Cache-Control"])
        root.rename(gone)  # the origin goes down
        time.sleep(max(0.0, expires - time.time()) + 0.5)
        status, headers, body = get(url)
        assert status == 502 and b"expired at " + format_expiry(expires).encode() in body
        assert node.metrics()["kvcdn_edge_stale_expired_refused_total"] == 1
    finally:
        node.kill()
        if gone.exists():
            gone.rename(root)


@pytest.mark.parametrize("with_trust", [True, False], ids=["trust", "no-trust"])
def test_an_edge_serves_a_stale_pointer_until_its_expiry_and_never_after(
    signed, model, sed_text, tmp_path, with_trust
):
    root, key, trust_file, _ = signed
    extra = ("--pointer-ttl", "1", *(("--trust", str(trust_file)) if with_trust else ()))
    node = EdgeProcess(str(root), tmp_path / "cache", None, *extra).start()
    gone = root.with_name("gone")
    try:
        publish(text=sed_text[:2000], name="guide", model=model, store=str(root), levels=LEVEL,
                sign_keys=[key], pointer_valid_for=8)  # fmt: skip
        expires = parse_expiry(pointer_of(root)["expires"], "expires")
        url = f"{node.url}/{latest_key('guide')}"
        status, headers, body = get(url)
        assert status == 200 and "Warning" not in headers
        assert payload(body)["expires"] == format_expiry(expires)

        root.rename(gone)  # the origin goes down
        time.sleep(1.2)  # past the --pointer-ttl the edge reuses a pointer without asking
        status, headers, body = get(url)
        assert time.time() < expires, "the machine was too slow to see the stale window"
        assert status == 200 and headers["Warning"] == '110 - "Response is Stale"'
        assert payload(body)["version"] == 1

        time.sleep(max(0.0, expires - time.time()) + 0.5)
        status, headers, body = get(url)
        assert status == 502 and b"origin unavailable" in body
        assert b"expired at " + format_expiry(expires).encode() in body
        metrics = node.metrics()
        assert metrics["kvcdn_edge_stale_served_total"] == 1
        assert metrics["kvcdn_edge_stale_expired_refused_total"] == 1

        # restarted, it reads its disk copy, and still does not serve it stale
        node.kill()
        gone.rename(root)  # `edge serve` checks its origin on start
        node = EdgeProcess(str(root), tmp_path / "cache", None, *extra).start()
        root.rename(gone)
        status, _, body = get(f"{node.url}/{latest_key('guide')}")
        assert status == 502 and b"expired at" in body
        assert node.metrics()["kvcdn_edge_stale_expired_refused_total"] == 1
    finally:
        node.kill()
        if gone.exists():
            gone.rename(root)


def test_an_edge_passes_on_an_expired_pointer_from_its_origin_and_readers_refuse_it(
    signed, model, tmp_path
):
    root, key, trust_file, _ = signed
    expired = math.floor(time.time()) - 60
    write_pointer(root, key, 1, expired)
    node = EdgeProcess(str(root), tmp_path / "cache", None, "--trust", str(trust_file),
                       "--pointer-ttl", "1").start()  # fmt: skip
    gone = root.with_name("gone")
    try:
        url = f"{node.url}/{latest_key('guide')}"
        status, headers, body = get(url)  # fresh from the origin: passed on as it is
        assert status == 200 and payload(body)["expires"] == format_expiry(expired)
        assert node.metrics()["kvcdn_edge_expired_pointers_fetched_total"] == 1
        # a reader through the edge refuses it, naming the expiry, and loads nothing;
        # the skew allowance is set to none for a pointer only a minute past
        trust = TrustPolicy([key.public], clock_skew_s=0)
        with pytest.raises(PointerExpired, match=f"expired at {format_expiry(expired)}"):
            sdk.load_context("guide", model=model, edges=[node.url], quality=LEVEL, trust=trust)
        # ... recorded as a stale pointer, not as bad bytes: the edge is not skipped
        reader = EdgeStore([node.url], origin=open_store(str(root)))
        with pytest.raises(PointerExpired, match="every edge served a stale pointer|expired"):
            read_manifest(reader, "guide", trust=trust)
        (rejected,) = reader.rejected
        assert rejected.stale and rejected.edge == node.url
        assert str(rejected).startswith(f"{node.url} served a stale pointer for ")
        assert reader.fetch(manifest_key("guide", 1)).source == node.url
        # the origin down, it is not served stale either
        root.rename(gone)
        time.sleep(1.2)  # past --pointer-ttl
        status, _, body = get(url)
        assert status == 502 and b"expired at" in body
    finally:
        node.kill()
        if gone.exists():
            gone.rename(root)
