"""Every reader keeps the one ``Reader`` contract: a local folder, memory, S3 over HTTP
(moto), and the SDK's edge reader in front of a real edge process."""

from __future__ import annotations

import uuid

import pytest

from kvcdn import store as store_module
from kvcdn.errors import FormatError, IntegrityError, KvcdnError, NotFound
from kvcdn.sdk import EdgeStore
from kvcdn.store import Cancel, FetchCancelled, Reader, open_store
from tests.conftest import s3_target
from tests.edge_helpers import EdgeProcess, chunk_object

KEY, DATA = chunk_object(7)  # a real chunk container under its content key (about 1 MiB)
MISSING, _ = chunk_object(8)  # a valid key that no reader holds


@pytest.fixture(scope="module")
def edge_origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader-origin")
    open_store(str(root)).put(KEY, DATA)
    node = EdgeProcess(str(root), tmp_path_factory.mktemp("reader-edge-cache"), None).start()
    yield node
    node.kill()


@pytest.fixture(params=["local", "memory", "moto", "edge"])
def reader(request, tmp_path) -> Reader:
    kind = request.param
    if kind == "edge":
        edges = EdgeStore([request.getfixturevalue("edge_origin").url])
        yield edges
        edges.close()
        return
    bucket = None
    if kind == "local":
        found = open_store(str(tmp_path / "store"))
    elif kind == "memory":
        found = open_store(f"memory://readers-{uuid.uuid4().hex}")
    else:
        bucket = s3_target(request, "moto")  # a fresh bucket, its credentials set
        s3 = next(bucket)
        found = open_store(s3.url(), endpoint_url=s3.endpoint)
    found.put(KEY, DATA)
    yield found
    if bucket is not None:
        next(bucket, None)  # the credentials put back


def _fail(data: bytes) -> None:
    raise IntegrityError("the caller's check refused these bytes")


def test_get_and_fetch_return_the_same_bytes_and_say_where_from(reader):
    assert reader.get(KEY, max_bytes=len(DATA)) == DATA
    heard: list[int] = []
    got = reader.fetch(KEY, max_bytes=len(DATA), on_bytes=heard.append, placement="0" * 64)
    assert got.data == DATA and got.key == KEY
    assert got.source and got.seconds >= 0
    assert sum(heard) == len(DATA)  # every byte reported as it arrived


def test_an_object_larger_than_expected_is_refused(reader):
    for read in (reader.get, reader.fetch):
        with pytest.raises(FormatError):
            read(KEY, max_bytes=len(DATA) - 1)


def test_the_callers_check_decides(reader):
    for read in (reader.get, reader.fetch):
        with pytest.raises(KvcdnError, match="refused these bytes"):
            read(KEY, check=_fail)


def test_a_missing_key_is_not_found(reader):
    for read in (reader.get, reader.fetch):
        with pytest.raises(NotFound):
            read(MISSING)


def test_a_cancelled_fetch_stops(reader):
    cancel = Cancel()
    cancel.set()
    with pytest.raises(FetchCancelled):
        reader.fetch(KEY, cancel=cancel)


def test_an_object_ref_is_read_bounded_and_checked_by_itself(reader):
    """``fetch`` and ``get`` take a manifest's ObjectRef: its key, at most its size, its
    sha256 checked; the same through the SDK's deadline-bounded view."""
    import hashlib

    from kvcdn.manifest import ObjectRef
    from kvcdn.sdk.bounded import BoundedReader

    ref = ObjectRef(KEY, len(DATA), hashlib.sha256(DATA).hexdigest())
    for source in (reader, BoundedReader(reader).within(None)):
        assert source.get(ref) == DATA
        assert source.fetch(ref).key == KEY
        with pytest.raises(FormatError):  # the object is larger than its ref says
            source.fetch(ObjectRef(KEY, len(DATA) - 1, ref.sha256))
        with pytest.raises(IntegrityError):  # its bytes are not the ones the ref names
            source.get(ObjectRef(KEY, len(DATA), "0" * 64))
        with pytest.raises(KvcdnError, match="refused these bytes"):  # both checks run
            source.get(ref, check=_fail)
        with pytest.raises(IntegrityError, match="does not match"):  # the ref's, first
            source.get(ObjectRef(KEY, len(DATA), "0" * 64), check=lambda data: None)


def test_a_span_is_read_as_exactly_its_bytes(reader):
    """An ObjectSpan reads bytes [start, end) of its object (a ranged GET on S3 and on the
    edge, a seek on a file), reported as they arrive; a span past the object's end
    fails its length check; the caller's check runs on the span's bytes."""
    import hashlib

    from kvcdn.manifest import ObjectRef, ObjectSpan
    from kvcdn.sdk.bounded import BoundedReader

    ref = ObjectRef(KEY, len(DATA), hashlib.sha256(DATA).hexdigest())
    size = len(DATA)
    for source in (reader, BoundedReader(reader).within(None)):
        for start, end in ((0, 100), (1000, 300_000), (size - 7, size), (12345, 12346)):
            heard: list[int] = []
            got = source.fetch(ObjectSpan(ref, start, end), on_bytes=heard.append)
            assert got.data == DATA[start:end] and sum(heard) == end - start
        with pytest.raises(KvcdnError):  # the object ends before the span does
            source.fetch(ObjectSpan(ref, size - 10, size + 10))
        with pytest.raises(KvcdnError, match="refused these bytes"):
            source.fetch(ObjectSpan(ref, 0, 10), check=_fail)


def test_listing_finds_the_key(reader):
    prefix = KEY.split("/", 1)[0] + "/"
    assert KEY in reader.list(prefix)


@pytest.mark.parametrize("piece", [100_000, len(DATA), len(DATA) // 2])
def test_stores_read_in_pieces_and_stop_between_them(tmp_path, monkeypatch, piece):
    """A store's fetch reads ranged pieces (one GET each on S3): every piece is reported,
    an object an exact multiple of the piece size ends cleanly, and a cancel set while
    reading stops before the next piece."""
    monkeypatch.setattr(store_module, "FETCH_PIECE", piece)
    local = open_store(str(tmp_path / "store"))
    local.put(KEY, DATA)
    for max_bytes in (None, len(DATA)):
        heard: list[int] = []
        assert local.fetch(KEY, max_bytes=max_bytes, on_bytes=heard.append).data == DATA
        assert heard[0] == min(piece, len(DATA)) and sum(heard) == len(DATA)
    if piece < len(DATA):
        cancel = Cancel()
        with pytest.raises(FetchCancelled):
            local.fetch(KEY, on_bytes=lambda n: cancel.set(), cancel=cancel)
