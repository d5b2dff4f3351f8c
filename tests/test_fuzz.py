"""Fuzzing the parsers of everything read from a store, an edge or a client (hypothesis).

Each parser must either accept its input or refuse it with its own error
type: never another exception, never a crash, never a signed document whose
content changed. Example counts are bounded so the module runs in about a
minute.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn import jsonfmt, keys
from kvcdn.codec_profile import parse_profile
from kvcdn.errors import FormatError, InputError, IntegrityError, TrustError
from kvcdn.manifest import open_manifest, open_pointer, parse_manifest
from kvcdn.signing import MANIFEST_TYPE, SigningKey, TrustPolicy, read_public_keys, seal
from tests.test_format import _manifest_json

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = SigningKey.generate("fuzz")
TRUST = TrustPolicy([KEY.public])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)


def _mutate(data: st.DataObject, tree: Any) -> Any:
    """Replace or delete one node of a JSON tree, chosen by walking down from the root."""
    if isinstance(tree, dict) and tree and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(tree)))
        if data.draw(st.integers(0, 4)) == 0:
            return {k: v for k, v in tree.items() if k != key}
        return {**tree, key: _mutate(data, tree[key])}
    if isinstance(tree, list) and tree and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(tree) - 1))
        return [*tree[:i], _mutate(data, tree[i]), *tree[i + 1 :]]
    return data.draw(json_values)


@FUZZ
@given(st.data())
def test_mutated_manifests_are_refused_or_fully_valid(data):
    raw = _mutate(data, _manifest_json())
    try:
        manifest = parse_manifest(json.dumps(raw).encode())
    except FormatError:
        return
    # whatever was accepted is self-consistent, canonical and bounded
    assert parse_manifest(manifest.dumps()).to_json() == manifest.to_json()
    for chunk in manifest.chunks:
        for ref in chunk.objects.values():
            info = keys.parse_key(ref.key)
            assert info is not None and info.kind == "object" and info.chunk_hash == chunk.hash
    assert manifest.kv_layout["layers"] <= 1024 and manifest.token_count <= 1 << 24


SIGNED = seal(json.dumps(_manifest_json()).encode(), MANIFEST_TYPE, [KEY])
ORIGINAL = parse_manifest(json.dumps(_manifest_json()).encode()).to_json()


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SIGNED) - 1), st.integers(0, 255)), max_size=4))
def test_altered_signed_manifests_never_verify_with_other_content(edits):
    data = bytearray(SIGNED)
    for at, value in edits:
        data[at] = value
    for trust in (TRUST, None):
        try:
            manifest = open_manifest(bytes(data), name="fuzzed", trust=trust)
        except (FormatError, TrustError):
            continue
        assert manifest.to_json() == ORIGINAL  # the signature binds the content
        assert manifest.signer is not None and manifest.signer.key.raw == KEY.public.raw


@FUZZ
@given(json_values)
def test_pointers_are_refused_or_valid(raw):
    for data in (json.dumps(raw).encode(), seal(json.dumps(raw).encode(), "x", [KEY])):
        try:
            pointer = open_pointer(data, what="fuzzed pointer")
        except (FormatError, IntegrityError):
            continue
        assert keys.parse_key(keys.manifest_key(pointer.name, pointer.version)) is not None


@FUZZ
@given(st.binary(max_size=3000))
def test_strict_json_on_random_bytes(data):
    try:
        jsonfmt.loads(data, what="fuzzed", max_bytes=2000)
    except FormatError:
        pass
    assert jsonfmt.nesting(data) >= 0


@FUZZ
@given(st.data())
def test_profiles_with_bytes_changed_are_refused_or_parsed(profile, data):
    blob = bytearray(profile.to_bytes())
    header_end = 8 + int.from_bytes(blob[:8], "little")
    for _ in range(data.draw(st.integers(1, 3))):
        # mostly in the header and metadata, where a mistake could mislead the parser
        at = data.draw(st.integers(0, header_end + 64))
        blob[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(blob), len(blob) - 1, header_end, 7]))
    try:
        parse_profile(bytes(blob[:cut]), name="fuzzed profile")
    except FormatError:
        pass


@FUZZ
@given(st.text(max_size=400))
def test_trust_files_are_read_or_refused_with_a_line_number(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("trust") / "trust.pub"
    path.write_text(text, encoding="utf-8")
    try:
        assert read_public_keys(path)
    except InputError as exc:
        assert "trust file" in str(exc) or "line" in str(exc)


@pytest.mark.parametrize(
    "kind", ["object", "profile", "manifest", "pointer", "index", "prefix-index"]
)
@FUZZ
@given(data=st.binary(max_size=600))
def test_edge_verification_of_random_bytes(kind, data):
    from kvcdn.edge.verify import VerifyError, verify

    key = {
        "object": keys.object_key("a" * 64, "fp16-0123456789ab", "b" * 64),
        "profile": keys.profile_key("c" * 64, "d" * 64),
        "manifest": keys.manifest_key("doc", 1),
        "pointer": keys.latest_key("doc"),
        "index": keys.source_index_key("c" * 64, "e" * 64),
        "prefix-index": keys.prefix_index_key("c" * 64, "e" * 64),
    }[kind]
    info = keys.parse_key(key)
    for trust in (None, TRUST):
        try:
            verify(key, info, data, trust)
        except VerifyError:
            pass


@FUZZ
@given(
    st.text(max_size=300),
    st.dictionaries(st.sampled_from(["X-Amz-Date", "Host", "x-amz-content-sha256"]),
                    st.text(max_size=40)),
    st.text(max_size=200),
)  # fmt: skip
def test_s3_signatures_of_random_requests_are_refused(authorization, headers, query):
    from kvcdn.edge.s3api import S3RequestError
    from kvcdn.edge.s3auth import S3Keys

    s3_keys = S3Keys({"AKIDFUZZ": "fuzz-secret-123"})
    with pytest.raises(S3RequestError) as refused:
        s3_keys.verify(
            "GET", "127.0.0.1:1", f"/kvcdn/x?{query}", {**headers, "Authorization": authorization}
        )
    assert refused.value.status == 403


@FUZZ
@given(st.text(max_size=300))
def test_keys_parse_only_canonical_spellings(text):
    info = keys.parse_key(text)
    if info is None:
        return
    rebuilt = {
        "object": lambda: keys.object_key(info.chunk_hash, info.level_id, info.sha256),
        "manifest": lambda: keys.manifest_key(info.name, info.version),
        "pointer": lambda: keys.latest_key(info.name),
    }.get(info.kind)
    if rebuilt is not None:
        assert rebuilt() == text
