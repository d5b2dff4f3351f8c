"""The chunk container and the manifest: strict, defensive parsing."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn import jsonfmt, keys
from kvcdn.codec import FIXED_LEVELS as LEVELS
from kvcdn.codec import decode_chunk, encode_chunk
from kvcdn.container import MAGIC, ChunkHeader, pack, unpack
from kvcdn.errors import FormatError, IntegrityError
from kvcdn.kv import split_chunks
from kvcdn.manifest import SCHEMA_VERSION, parse_manifest

HASH = "ab" * 32


def _kv(tokens: int = 8) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 2, 3, tokens, 16)


def _object() -> bytes:
    return encode_chunk(LEVELS["int8"], _kv(), HASH)


def test_container_round_trip() -> None:
    header = ChunkHeader("fp16", "fp16", {}, (2, 2, 3, 8, 16), HASH)
    data = pack(header, b"x" * 100)
    assert data.startswith(MAGIC)
    parsed, body = unpack(data)
    assert parsed == header and body.version == 1
    assert bytes(body.payload) == b"x" * 100


def test_flipped_byte_fails_checksum() -> None:
    data = bytearray(_object())
    data[len(data) // 2] ^= 0x01
    with pytest.raises(IntegrityError, match="checksum"):
        unpack(bytes(data), name="objects/x")


@pytest.mark.parametrize("cut", [0, 10, 23, 100, -1, -33])
def test_truncated_object_is_refused(cut: int) -> None:
    with pytest.raises(FormatError):
        unpack(_object()[:cut])


def test_padded_object_is_refused() -> None:
    with pytest.raises(FormatError, match="lengths add up"):
        unpack(_object() + b"\0")


def test_oversized_header_length_is_refused_before_reading() -> None:
    data = bytearray(_object())
    struct.pack_into("<I", data, 12, 1 << 30)
    with pytest.raises(FormatError, match="header"):
        unpack(bytes(data))


def test_unknown_format_version_is_refused() -> None:
    data = bytearray(_object())
    struct.pack_into("<H", data, 8, 99)
    with pytest.raises(FormatError, match="version 99"):
        unpack(bytes(data))


@pytest.mark.parametrize(
    "header",
    [
        {"codec": "fp16", "level": "fp16", "params": {}, "shape": [2, 2, 3], "chunk_hash": HASH},
        {
            "codec": "fp16",
            "level": "fp16",
            "params": {},
            "shape": [2, 3, 3, 8, 16],
            "chunk_hash": HASH,
        },
        {
            "codec": "fp16",
            "level": "fp16",
            "params": {},
            "shape": [2, 2, 3, 8, 16],
            "chunk_hash": "nothex",
        },
        {"codec": 5, "level": "fp16", "params": {}, "shape": [2, 2, 3, 8, 16], "chunk_hash": HASH},
        [1, 2, 3],
    ],
)
def test_invalid_headers_are_refused(header: object) -> None:
    import hashlib

    head = json.dumps(header).encode()
    body = struct.pack("<8sHHIQ", MAGIC, 1, 0, len(head), 0) + head
    with pytest.raises(FormatError):
        unpack(body + hashlib.sha256(body).digest())


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_fuzzed_objects_raise_only_format_errors(data: st.DataObject) -> None:
    """Any mutation of a valid object is either rejected cleanly or decodes to its shape."""
    original = bytearray(_object())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(original) - 1))
        original[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(original)))
    try:
        header, kv = decode_chunk(bytes(original[:cut]))
    except FormatError:
        return
    assert tuple(kv.shape) == header.shape


@pytest.mark.parametrize("level", ["fp16", "int8"])
def test_levels_round_trip_with_bounded_error(level: str) -> None:
    kv = _kv(32) * 3
    header, out = decode_chunk(encode_chunk(LEVELS[level], kv, HASH))
    assert header.level == level and header.chunk_hash == HASH
    assert out.shape == kv.shape and out.dtype == torch.float16
    err = (out.float() - kv).abs()
    if level == "fp16":
        assert err.max() <= kv.abs().max() * 2**-10
    else:  # half a quantisation step of each channel
        step = kv.abs().amax(dim=3, keepdim=True) / 127
        assert (err <= step / 2 + 1e-2).all()


def test_int8_payload_that_inflates_beyond_its_shape_is_refused() -> None:
    import zstandard

    header = ChunkHeader("int8-channel-zstd", "int8", {}, (1, 2, 1, 4, 4), HASH)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
    with pytest.raises(FormatError):
        decode_chunk(pack(header, bomb))


# ---- chunk identity --------------------------------------------------------------


def test_chain_hashes_share_an_unchanged_prefix_only() -> None:
    ids = list(range(1000))
    changed = ids[:600] + [7] + ids[601:]
    a = split_chunks("f" * 64, ids, 256)
    b = split_chunks("f" * 64, changed, 256)
    assert [c.hash for c in a[:2]] == [c.hash for c in b[:2]]
    assert all(x.hash != y.hash for x, y in zip(a[2:], b[2:], strict=True))
    assert [(c.start, c.end) for c in a] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    other_model = split_chunks("e" * 64, ids, 256)
    assert other_model[0].hash != a[0].hash


# ---- manifest --------------------------------------------------------------------


H0, H1, SHA0, SHA1 = "a" * 64, "b" * 64, "c" * 64, "d" * 64
LEVEL_ID = "fp16-0123456789ab"


def _manifest_json() -> dict:
    tokens = list(range(10))
    return {
        "schema_version": SCHEMA_VERSION,
        "document": {"name": "doc", "source_sha256": HASH, "source_bytes": 40},
        "version": 1,
        "created_at": "2026-11-21T00:00:00+00:00",
        "model": {"name": "smollm2-135m", "fingerprint": HASH},
        "tokenizer": "x",
        "token_count": 10,
        "chunk_tokens": 8,
        "kv_layout": {"layers": 2, "kv_heads": 3, "head_dim": 16, "dtype": "float32"},
        "levels": {
            "fp16": {
                "id": LEVEL_ID,
                "codec": "fp16",
                "params": {},
                "total_bytes": 9,
                "bits_per_element": 16.0,
                "quality": {"kl": 0.001, "ppl_delta_pct": -0.4, "top1_agree": 0.97},
            }
        },
        "codec_profile": {"key": keys.profile_key(HASH, SHA0), "bytes": 10, "sha256": SHA0},
        "chunks": [
            {
                "index": 0,
                "start": 0,
                "end": 8,
                "hash": H0,
                "tokens": tokens[:8],
                "objects": {
                    "fp16": {"key": keys.object_key(H0, LEVEL_ID, SHA0), "bytes": 5, "sha256": SHA0}
                },
            },
            {
                "index": 1,
                "start": 8,
                "end": 10,
                "hash": H1,
                "tokens": tokens[8:],
                "objects": {
                    "fp16": {"key": keys.object_key(H1, LEVEL_ID, SHA1), "bytes": 4, "sha256": SHA1}
                },
            },
        ],
    }


def test_manifest_round_trip() -> None:
    m = parse_manifest(json.dumps(_manifest_json()).encode())
    assert m.token_ids == list(range(10))
    assert parse_manifest(m.dumps()).to_json() == m.to_json()


def test_unknown_schema_version_is_refused() -> None:
    raw = _manifest_json() | {"schema_version": 99}
    with pytest.raises(FormatError, match="schema_version 99"):
        parse_manifest(json.dumps(raw).encode())


def _ref(m: dict, i: int = 0) -> dict:
    return m["chunks"][i]["objects"]["fp16"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.pop("chunks"),
        lambda m: m["chunks"][1].update(start=9),
        lambda m: m["chunks"][0]["tokens"].append(3),
        lambda m: m.update(token_count=11),
        lambda m: m["chunks"][0]["objects"].update(int8={"key": "k", "bytes": 1, "sha256": HASH}),
        lambda m: _ref(m).update(sha256="xyz"),
        lambda m: m["document"].update(name="../etc"),
        lambda m: m["kv_layout"].update(layers=0),
        # bounds checked before anyone allocates for them
        lambda m: m["kv_layout"].update(layers=10**12),
        lambda m: m["kv_layout"].update(head_dim=3000),
        lambda m: m["kv_layout"].update(dtype="float128"),
        lambda m: m["kv_layout"].update(extra=1),
        lambda m: m.update(token_count=10**9),
        lambda m: m["chunks"][0]["tokens"].__setitem__(0, 1 << 40),
        # every object key is the canonical key of its chunk, level and sha256
        lambda m: _ref(m).update(key="../../../../etc/passwd"),
        lambda m: _ref(m).update(key=keys.object_key(H1, LEVEL_ID, SHA0)),
        lambda m: _ref(m).update(key=keys.object_key(H0, LEVEL_ID, SHA1)),
        lambda m: _ref(m).update(sha256=SHA1),
        lambda m: m["levels"]["fp16"].update(id="fp16-x"),
        lambda m: m["levels"]["fp16"].update(id="int8-0123456789ab"),
        lambda m: m["codec_profile"].update(key="profiles/x/y.safetensors"),
        lambda m: _ref(m).update(bytes=1 << 40),
    ],
)
def test_inconsistent_manifests_are_refused(mutate) -> None:
    raw = _manifest_json()
    mutate(raw)
    with pytest.raises(FormatError):
        parse_manifest(json.dumps(raw).encode(), name="manifest docs/x")


def test_json_bombs_are_refused_before_parsing() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(FormatError, match="nests 100000 levels"):
        parse_manifest(deep)
    text = json.dumps(_manifest_json())
    with pytest.raises(FormatError, match="duplicate key"):
        parse_manifest(text.replace('"version": 1,', '"version": 1, "version": 2,').encode())
    with pytest.raises(FormatError, match="NaN"):
        parse_manifest(text.replace('"bits_per_element": 16.0', '"bits_per_element": NaN').encode())
    # brackets inside strings are not nesting
    assert jsonfmt.nesting(json.dumps({"a": "[[[[{{{{" * 100, "b": [[1]]}).encode()) == 3


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_are_not_a_manifest(data: bytes) -> None:
    with pytest.raises(FormatError):
        parse_manifest(data)
