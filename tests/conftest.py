"""Shared fixtures: the real embedded model, real documents, real S3 endpoints."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SED_MANUAL = REPO / "cli" / "data" / "sed-manual.txt"  # `man sed`, a real document

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Workers share the cores. PyTorch's OpenMP threads spin at each barrier, so two
    # processes running two each on two cores waited on one another: files took
    # several times their time alone. One thread each (set before torch is imported,
    # and inherited by the CLI processes tests run); vLLM's workers bind their own.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep tests away from the user's store and AWS profile."""
    os.environ["KVCDN_STORE"] = str(tmp_path_factory.mktemp("default-store"))
    # A fresh profile cache: the embedded model's profile comes from the package
    # (tests/test_calibrate.py checks it), never from an earlier run's cache.
    os.environ["KVCDN_PROFILE_CACHE"] = str(tmp_path_factory.mktemp("profiles"))
    # ... and measures this device itself, once: speeds measured by another process
    # (on a machine that was busy then) must not steer the planner's tests.
    os.environ["KVCDN_SPEED_CACHE"] = str(tmp_path_factory.mktemp("speeds") / "device-speed.json")
    # vLLM's and torch inductor's caches of what they compile (C++ kernels, even in eager
    # mode): shared by the session's vLLM processes, each of which would compile the same
    # kernels again in a folder of its own (about 16 s of an engine's start and first
    # step), and kept out of the user's.
    compiled = tmp_path_factory.mktemp("compile-caches")
    os.environ["VLLM_CACHE_ROOT"] = str(compiled / "vllm")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compiled / "inductor")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "kvcdn-test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "kvcdn-test-secret")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_ENDPOINT_URL", None)


@pytest.fixture(scope="session")
def model():
    from kvcdn.models import load_model

    return load_model("smollm2-135m", "cpu")


@pytest.fixture(scope="session")
def profile(_isolated_home, model):
    """The embedded model's codec profile: the one shipped with kvcdn, which
    ``make embedded-profile`` calibrated on the bundled texts (the suite calibrates
    on shorter texts only, in tests/test_calibrate.py)."""
    from kvcdn.profile_store import ensure_profile
    from kvcdn.store import open_store

    found, _ = ensure_profile(open_store("memory://conftest-profile"), model)
    return found


@pytest.fixture(scope="session")
def channels_profile(_isolated_home, model):
    """The embedded profile with a nested ladder of channels (kvcdn-nested-v1, what
    ``kvcdn calibrate --no-transform`` makes): its transform taken off. Its steps and
    tables were planned for KLT coefficients, which is no matter to the tests of the
    channels' codec (its arithmetic, what a reader fetches, damage), only to quality."""
    import dataclasses

    from kvcdn.codec_profile import parse_profile
    from kvcdn.profile_store import ensure_profile
    from kvcdn.store import open_store

    # not the `profile` fixture: tests/test_nested.py names this one `profile`
    profile, _ = ensure_profile(open_store("memory://conftest-profile"), model)
    assert profile.nested is not None and profile.nested.transform is not None
    nested = dataclasses.replace(profile.nested, transform=None)
    return parse_profile(dataclasses.replace(profile, nested=nested).to_bytes())


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory, model) -> Path:
    """A random-weight Llama folder with 4 KV heads and a 40K context window
    (:mod:`tests.random_llama`), built once per session: a query head a KV head, which
    halves the attention of its 33K-token prefills (about 45 s of the suite)."""
    from tests.random_llama import KV_HEADS, build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("random-llama"), query_heads=KV_HEADS)


@pytest.fixture(scope="session")
def sed_text() -> str:
    return SED_MANUAL.read_text()


@pytest.fixture(scope="session")
def short_text(sed_text: str) -> str:
    """The first ~700 tokens of the sed manual: a real document that prefills fast."""
    return sed_text[:3000]


def signed_store(tmp_path_factory, model, documents: list[tuple[str, str]], levels: str = "int8"):
    """A store folder with ``documents`` ((name, text) in publishing order) signed by a
    fresh key; (its root, the key, the key's .pub file, as a trust file)."""
    from kvcdn.publish import publish
    from kvcdn.signing import SigningKey
    from kvcdn.store import open_store

    base = tmp_path_factory.mktemp("signed")
    key = SigningKey.generate("publisher")
    key.save(base / "publisher.key")
    store = open_store(str(base / "store"))
    for name, text in documents:
        publish(text=text, name=name, model=model, store=store, levels=levels, sign_keys=[key])
    return base / "store", key, base / "publisher.key.pub"


def payload(data: bytes) -> dict:
    """The JSON document in stored bytes, plain or inside a signed envelope."""
    import base64
    import json

    raw = json.loads(data)
    return json.loads(base64.b64decode(raw["payload"])) if "payloadType" in raw else raw


def _port_slice() -> range:
    """The ports this test process hands out: its share of 20000-32767, below the
    kernel's ephemeral range (32768 and up here and by default), so that no port the
    kernel picks (a server binding port 0, an outgoing connection) can take one given
    and not bound yet; above Ray's worker ports (10002-19999). Each pytest-xdist worker
    has a slice of its own: two workers never give out the same port."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    width = (32768 - 20000) // max(workers, 1)
    return range(20000 + index * width, 20000 + (index + 1) * width)


PORTS = _port_slice()
_ports = iter(PORTS)


def free_port() -> int:
    """A port nothing listens on now, that the kernel does not hand out, and that this
    session has not given before: two servers told the same port (or an origin meant
    to be dead told a live edge's) fail at random."""
    for port in _ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: by a server of this run, or anything else here
                continue
        return port
    raise RuntimeError(f"every port of {PORTS} was given out")


#: Files whose engines take both cores (vLLM at TP=2 and PP=2), run last under xdist.
BOTH_CORES = ("test_vllm_parallel.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """For pytest-xdist (``make test``: ``-n 2 --dist loadfile --no-loadscope-reorder``,
    each file whole on one worker, handed out in this order): the single-engine vLLM
    tests, the longest file (about 4.5 minutes), first, so that it does not end the run
    alone; the parallel engines' file last, where it has the cores to itself, or
    nearly, instead of beside the other engine's file."""
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return 0 if name == "test_vllm.py" else 2 if name in BOTH_CORES else 1

    items.sort(key=rank)  # stable: the others keep their order


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real local Ray cluster of 2 CPUs for the session (as `kvcdn publish --ray` joins
    one); its address lets CLI processes join it too."""
    import logging

    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvcdn[ray]')")
    # Ray 2.60 writes a token to ~/.ray unless told not to; the tests keep to their tmp.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
        _temp_dir=str(tmp_path_factory.mktemp("ray")), logging_level=logging.WARNING,
        log_to_driver=False,
    )  # fmt: skip
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory):
    """moto's S3 server on a real loopback HTTP port (as s3fs's own tests run it)."""
    from moto.server import ThreadedMotoServer

    # moto's request recorder (used by the edge tests) writes here, not in the checkout
    os.environ["MOTO_RECORDER_FILEPATH"] = str(tmp_path_factory.mktemp("moto") / "recording")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def ceph_endpoint(tmp_path_factory: pytest.TempPathFactory):
    """A single-node Ceph RADOS Gateway, where radosgw is installed and we are root."""
    from tests.ceph_rgw import CephRGW, ceph_unavailable_reason

    reason = ceph_unavailable_reason()
    if reason:
        pytest.skip(f"Ceph RGW run skipped: {reason}")
    for attempt in range(2):  # a fresh cluster (folder, ports) for the second try
        rgw = CephRGW(tmp_path_factory.mktemp("ceph"))
        try:
            rgw.start()
            break
        except Exception as exc:  # a broken install is reported, not hidden
            rgw.stop()
            if attempt == 1:
                pytest.fail(f"Ceph RGW is installed but did not start: {exc}")
    yield rgw
    rgw.stop()


@pytest.fixture(params=["moto", pytest.param("ceph", marks=pytest.mark.ceph)])
def s3(request: pytest.FixtureRequest):
    """(endpoint URL, credentials) of each S3-compatible server, with a fresh bucket."""
    yield from s3_target(request, request.param)


def s3_target(request: pytest.FixtureRequest, server: str):
    """A fresh bucket on ``server`` (moto or ceph), its credentials in the environment."""
    import boto3

    if server == "moto":
        endpoint = request.getfixturevalue("moto_endpoint")
        creds = {
            "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
        }
    else:
        rgw = request.getfixturevalue("ceph_endpoint")
        endpoint = rgw.endpoint
        creds = {"aws_access_key_id": rgw.access_key, "aws_secret_access_key": rgw.secret_key}
    bucket = f"kvcdn-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)
    client.create_bucket(Bucket=bucket)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"] = creds["aws_access_key_id"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = creds["aws_secret_access_key"]
    yield S3Target(server, endpoint, bucket, client)
    for key, value in saved.items():
        if value is not None:
            os.environ[key] = value


@pytest.fixture(
    name="store", params=["local", "moto", pytest.param("ceph", marks=pytest.mark.ceph)]
)
def store_everywhere(request, tmp_path):
    """``store``: a fresh store on a local folder, on moto and on Ceph RGW (where
    installed); modules with a ``store`` fixture of their own use theirs."""
    from kvcdn.store import open_store

    if request.param == "local":
        yield open_store(str(tmp_path / "store"))
        return
    for target in s3_target(request, request.param):
        yield open_store(target.url(), endpoint_url=target.endpoint)


class S3Target:
    def __init__(self, server: str, endpoint: str, bucket: str, client) -> None:
        self.server = server
        self.endpoint = endpoint
        self.bucket = bucket
        self.client = client

    def url(self, prefix: str = "kv") -> str:
        return f"s3://{self.bucket}/{prefix}"


def all_intact(store, model) -> int:
    """Every object every version in ``store`` names is whole (`kvcdn check`), and every
    version loads at its first stored level (loaded, not recomputed); the count of
    versions."""
    from kvcdn import sdk
    from kvcdn.catalog import read_manifest
    from kvcdn.check import check_store
    from kvcdn.keys import parse_key

    report = check_store(store)
    assert report.ok, report.problems
    checked = 0
    for key in store.list("docs/"):
        info = parse_key(key)
        if info is None or info.kind != "manifest":
            continue
        manifest = read_manifest(store, info.name, info.version)
        level = next(lv for lv in manifest.levels if lv != "text")
        ctx = sdk.load_context(manifest.ref, model=model, store=store, quality=level)
        assert ctx.token_ids == manifest.token_ids
        assert set(ctx.plan.chunk_levels) == {level}
        checked += 1
    return checked
