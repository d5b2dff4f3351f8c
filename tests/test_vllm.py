"""kvcdn inside a real vLLM engine (vllm-cpu): loading published KV, failures that vLLM
recomputes, publishing from vLLM's prefill, and ``vllm serve`` behind edges.

One engine serves the whole module (tests/vllm_driver.py, 20-100 s to start); the
``vllm serve`` test starts its own server. Skipped where vLLM is not installed
(``pip install 'kvcdn[vllm]'``; ``make test`` installs it).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvcdn import keys
from kvcdn.document import read_document
from kvcdn.kv import chain_hash
from kvcdn.manifest import pointer_bytes
from kvcdn.models import kv_from_cache, user_message
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.cli_json import parsed
from tests.conftest import REPO, SED_MANUAL, free_port, signed_store

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install 'kvcdn[vllm]')",
    ),
]

QUESTION = "What does sed do?"  # see sed_excerpt
ACME = "acme's salt"  # a tenant of `vllm serve`'s, named acme on /metrics
TENANT_A = "tenant-a salt"  # configured as the salt itself
TENANT_B = "tenant-b salt"  # configured as sha256:HEX of it
BEHIND_A_HANGING_EDGE = "hanging-edge salt"  # a tenant that reads through an edge that hangs
HANGING_STORE = "hanging-store salt"  # a tenant whose S3 endpoint accepts and never answers
TRUSTED = "trusted salt"  # a signed store, read with its trust file and a record of it
ROLLED_BACK = "rolled-back salt"  # the same, its record past the store's version
#: How vLLM prefixes its own log lines: kvcdn's lines inside vLLM carry the same fields.
VLLM_LINE = re.compile(r"^\(\S+ pid=\d+\) (DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d "
                       r"\[[\w.]+:\d+\] ")
#: Bound on KL(vLLM's own prefill || kvcdn's default level) over the first answer
#: token's top-20 logprobs (docs/vllm.md gives the measured values).
KL_BOUND = 0.05


def _engine_dtype() -> str:
    """The dtype the module's engines run in: what ``kvcdn publish --engine vllm`` picks,
    vLLM's own choice on CPU (bfloat16) where the CPU computes bfloat16 at speed (it
    needs AVX-512), float32 elsewhere. On an AVX2-only CPU (an AMD EPYC of this
    project's machines) a 2,800-token prefill took about 50 s in bfloat16 instead of 3:
    the module's engines took 20 minutes there. The connector's float32 writes are
    checked wherever the engine runs in float32 (tests/test_vllm_parallel.py always)."""
    from kvcdn.sdk.vllm import engine_dtype

    return engine_dtype("auto", cuda=False)


ENGINE_DTYPE = _engine_dtype() if importlib.util.find_spec("vllm") else "auto"


def _vllm_env() -> dict[str, str]:
    """A vLLM process's environment: the session's (its compile caches: conftest)."""
    env = os.environ.copy()
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB: the default check fails on these machines
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        PYTHONUNBUFFERED="1",
    )
    return env


class Engine:
    """The driver process: one request at a time, a JSON line each way."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc = proc
        self.log = log

    def read_reply(self, timeout_s: float = 300) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            if line.startswith("REPLY "):
                return json.loads(line[6:])
            assert time.monotonic() < deadline, "the vLLM driver did not answer"
        raise AssertionError(f"the vLLM driver exited: {self.log.read_text()[-3000:]}")

    def ask(self, prompt_ids: list[int], *, reset: bool = True,
            beside: list[list[int]] | None = None, capture: bool = False,
            cache_salt: str | None = None, **params) -> dict:  # fmt: skip
        """One request (``params``: its kv_transfer_params), and ``beside`` it in the same
        batch, plain requests kvcdn keeps out of; with ``capture``, its prompt's KV is
        captured (the reply's ``capture`` names it in the engine's capture folder)."""
        assert self.proc.stdin is not None
        line = {"prompt_ids": prompt_ids, "params": params, "reset_prefix_cache": reset,
                "beside": beside or [], "capture": capture, "cache_salt": cache_salt}  # fmt: skip
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()
        return self.read_reply()


def sed_excerpt() -> str:
    """What the module's engines read: the start of sed's manual, 1,320 tokens (five
    whole chunks and a part). The whole manual (2,818 tokens) cost a float32 engine on
    an AVX2 CPU about 25 s a prefill, two or three of them a test, and checks nothing
    more. With QUESTION, the greedy answer's two best logits stay 0.3 or more apart for
    32 tokens (transformers, float32 and bfloat16 alike): the tests compare answers
    whole, and bf16 engines differ from run to run by a few hundredths (with the whole
    manual and the question about ``-n``, 0.02 apart at token 22; a cut at 1,189 tokens
    had its first token's two best 0.016 apart, and vLLM's first bf16 request answered
    differently from its later ones)."""
    text = read_document(SED_MANUAL)
    return text[: text.index("\n", 5400) + 1]


@pytest.fixture(scope="module")
def sed_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sed-excerpt") / "sed.txt"
    path.write_text(sed_excerpt())
    return path


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, model, profile, sed_file) -> Path:
    """The sed excerpt published by kvcdn with transformers, fp16 included."""
    folder = tmp_path_factory.mktemp("vllm-store")
    publish(sed_file, name="sed", model=model, store=str(folder),
            levels="fp16,nearlossless,default")  # fmt: skip
    return folder


@contextlib.contextmanager
def _engine(tmp: Path, folder: str, extra: dict, **options):
    """The driver with a kvcdn connector configured by ``extra``; ``options``: more of
    the driver's configuration (``tensor_parallel_size``) and of its environment."""
    env = _vllm_env()
    env.update(options.pop("env", {}))
    config = {"folder": folder, "capture_dir": str(tmp), "extra": extra,
              "dtype": ENGINE_DTYPE, **options}  # fmt: skip
    log = tmp / "driver.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "vllm_driver.py"), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            env=env, cwd=tmp,
        )  # fmt: skip
    engine = Engine(proc, log)
    try:
        assert engine.read_reply(timeout_s=400)["ready"]
        yield engine
    finally:
        # vLLM's own graceful shutdown takes about 7 s (its worker, then the engine
        # core's 5 s timeout): the next tests run meanwhile, and the session's end
        # waits for it
        proc.stdin.close()
        _STOPPING.append(proc)


#: vLLM processes told to stop (drivers, `vllm serve`), waited for when the session ends.
_STOPPING: list[subprocess.Popen] = []


@atexit.register
def _wait_for_stopping_drivers() -> None:
    for proc in _STOPPING:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def hanging_edge(store_dir):
    """An edge in front of the store that accepts connections and never answers."""
    from tests.edge_helpers import Hostile

    hanging = Hostile(store_dir, mode="hang")
    yield hanging.url
    hanging.stop()


@pytest.fixture(scope="module")
def trust_records(tmp_path_factory, model) -> tuple[Path, Path, Path]:
    """The sed excerpt published signed (``fp16``, one version), its trust file, and a
    folder for the tenants' records of seen versions: ``rolled-back.json`` says that
    ``sed@5`` was seen (the store was rolled back while the engine was down)."""
    root, _key, trust_file = signed_store(tmp_path_factory, model, [("sed", sed_excerpt())],
                                          levels="fp16")  # fmt: skip
    records = tmp_path_factory.mktemp("trust-records")
    (records / "rolled-back.json").write_text('{"sed": 5}')
    return root, trust_file, records


@pytest.fixture(scope="module")
def engine(tmp_path_factory, store_dir, model, hanging_edge, trust_records):
    from kvcdn.models import model_folder

    # synchronous loads in layer order (4 groups of the model's 30 layers), beside the
    # forward pass; INFO: kvcdn's line for each layer-ordered load is checked. Four
    # tenants: one reads an empty store, one (named by its salt's digest) the same store,
    # one the same store through an edge that never answers, one an S3 endpoint that
    # never answers (the hanging edge's port: its reader's open hangs too).
    empty = tmp_path_factory.mktemp("tenant-a-store")
    tenants = {TENANT_A: {"store": str(empty)},
               f"sha256:{hashlib.sha256(TENANT_B.encode()).hexdigest()}": {"store": str(store_dir)},
               BEHIND_A_HANGING_EDGE: {"store": str(store_dir), "edges": [hanging_edge]},
               HANGING_STORE: {"store": "s3://kvcdn-hanging/kv", "endpoint_url": hanging_edge,
                               "name": "hanging"}}
    signed, trust_file, records = trust_records
    for salt, record in ((TRUSTED, "trusted.json"), (ROLLED_BACK, "rolled-back.json")):
        tenants[salt] = {"store": str(signed), "trust": str(trust_file),
                         "trust_state": str(records / record)}  # fmt: skip
    extra = {"store": str(store_dir), "model": "smollm2-135m", "lookup_ttl_s": 0,
             "layer_groups": 4, "tenants": tenants}  # fmt: skip
    with _engine(tmp_path_factory.mktemp("vllm-engine"), model_folder("smollm2-135m"),
                 extra, env={"VLLM_LOGGING_LEVEL": "INFO"}) as engine:  # fmt: skip
        yield engine


def _prompt(model, text: str, question: str) -> list[int]:
    """What vLLM's chat endpoint builds from kvcdn's message: the chat template, tokenized."""
    rendered = model.tokenizer.apply_chat_template(
        [user_message(text, question)], tokenize=False, add_generation_prompt=True
    )
    return list(model.tokenizer(rendered, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def sed_prompt(model) -> list[int]:
    return _prompt(model, sed_excerpt(), QUESTION)


@pytest.fixture(scope="module")
def baseline(engine, sed_prompt) -> dict:
    """vLLM's own prefill and answer (kvcdn kept out of the request)."""
    out = engine.ask(sed_prompt, kvcdn_load=False)
    assert out["num_cached_tokens"] == 0
    return out


def git_excerpt() -> str:
    """What the ``publish --engine vllm`` tests publish: the start of git's manual,
    about 1,000 tokens. The whole manual (3,263 tokens) cost those tests
    about 30 s of prefills, in vLLM and in transformers, and checks nothing more."""
    text = read_document(REPO / "kvcdn" / "data" / "calibration" / "git.txt")
    return text[: text.index("\n", 4000) + 1]


def _published_tokens(model) -> int:
    return len(model.document_ids(sed_excerpt()))


@pytest.mark.parametrize("mode", ["auto", "sync", "async"])
def test_fp16_load_answers_as_vllms_own_prefill(engine, model, store_dir, sed_prompt, baseline,
                                                mode):  # fmt: skip
    """Loaded synchronously (``auto`` for a local folder) or not, the whole blocks (256
    tokens here) the prompt shares with the document; a layer-ordered load reads each
    object's index once, whatever the number of groups."""
    layered = "loaded in 4 layer groups"
    before = engine.log.read_text().count(layered)
    out = engine.ask(sed_prompt, kvcdn_quality="fp16", kvcdn_load_mode=mode)
    shared = _published_tokens(model) - 1  # the document's last token merges with the question
    claimed = shared // 256 * 256
    assert out["num_cached_tokens"] == claimed
    outcome = dict(out["kv_transfer_params"]["kvcdn"])
    assert outcome.pop("deadline_s") >= 0.25  # the budget: vLLM's own prefill, predicted
    assert outcome == {
        "document": "sed@1", "quality": "fp16", "mode": "async" if mode == "async" else "sync",
        "claimed_tokens": claimed, "loaded_tokens": claimed,
    }  # fmt: skip
    assert out["token_ids"] == baseline["token_ids"]
    assert len(out["token_ids"]) == 32
    # a synchronous load ran in layer groups beside the forward pass, which waited for each
    log_text = engine.log.read_text()
    assert log_text.count(layered) == before + (mode != "async")
    if mode != "async":
        doc = json.loads((store_dir / keys.manifest_key("sed", 1)).read_bytes())
        objects = [c["objects"]["fp16"] for c in doc["chunks"][: claimed // 256]]
        whole = sum(o["bytes"] for o in objects)
        indexes = sum(o["index"]["bytes"] for o in objects)
        read = int(re.findall(r"loaded in 4 layer groups .*\((\d+) bytes read\)", log_text)[-1])
        # every section once, and each index at most once (none: held from an earlier load)
        assert read in (whole, whole - indexes)


def test_cache_salts_read_only_their_tenants_store(engine, model, sed_prompt, baseline):
    """vLLM's ``cache_salt`` picks the store a request reads: a tenant whose store lacks
    the document gets nothing, a salt no tenant has gets nothing, a tenant whose store
    has it loads it as an unsalted request does; no salt is written to the log."""
    claimed = (_published_tokens(model) - 1) // 256 * 256
    for salt in (TENANT_A, "a salt of nobody's"):
        out = engine.ask(sed_prompt, cache_salt=salt, kvcdn_quality="fp16")
        assert out["num_cached_tokens"] == 0 and out["kv_transfer_params"] is None, salt
        assert out["token_ids"] == baseline["token_ids"]
    out = engine.ask(sed_prompt, cache_salt=TENANT_B, kvcdn_quality="fp16")
    assert out["num_cached_tokens"] == claimed
    assert out["kv_transfer_params"]["kvcdn"]["loaded_tokens"] == claimed
    assert out["token_ids"] == baseline["token_ids"]
    log = engine.log.read_text()
    assert TENANT_B not in log and "nobody's" not in log


def test_a_tenant_whose_store_hangs_holds_up_no_other(engine, model, sed_prompt, baseline):
    """A tenant's S3 endpoint that accepts connections and never answers: its request
    waits for its lookup at most ``lookup_timeout_s`` and is computed by vLLM, and an
    unsalted request right after it loads from its own store. Before, one tenant's late
    lookup paused every tenant's lookups for 10 s, and its reader's open (from the
    engine's start) held the one lock every tenant's reader was opened under."""
    claimed = (_published_tokens(model) - 1) // 256 * 256
    out = engine.ask(sed_prompt, cache_salt=HANGING_STORE, kvcdn_quality="fp16")
    assert out["num_cached_tokens"] == 0 and out["kv_transfer_params"] is None
    assert out["token_ids"] == baseline["token_ids"]
    log = engine.log.read_text()
    assert "s3://kvcdn-hanging/kv (tenant hanging) did not answer a document lookup" in log
    after = engine.ask(sed_prompt, kvcdn_quality="fp16")
    assert after["kv_transfer_params"]["kvcdn"]["loaded_tokens"] == claimed
    assert after["token_ids"] == baseline["token_ids"]


def test_a_tenant_s_record_of_seen_versions_is_kept_and_held_to(
    engine, model, sed_prompt, baseline, trust_records
):
    """``trust_state``: a trusted lookup writes the version it verified to its tenant's
    record, and a record that has seen a newer version than the store offers (a store
    rolled back while the engine was down) refuses the store's: vLLM computes it."""
    records = trust_records[2]
    claimed = (_published_tokens(model) - 1) // 256 * 256
    out = engine.ask(sed_prompt, cache_salt=TRUSTED, kvcdn_quality="fp16")
    assert out["kv_transfer_params"]["kvcdn"]["loaded_tokens"] == claimed
    assert out["token_ids"] == baseline["token_ids"]
    assert json.loads((records / "trusted.json").read_text()) == {"sed": 1}
    out = engine.ask(sed_prompt, cache_salt=ROLLED_BACK, kvcdn_quality="fp16")
    assert out["num_cached_tokens"] == 0 and out["kv_transfer_params"] is None
    assert out["token_ids"] == baseline["token_ids"]
    log = engine.log.read_text()
    assert "offers sed@1 as the latest version, but this reader has already seen sed@5" in log
    assert json.loads((records / "rolled-back.json").read_text()) == {"sed": 5}


def _kl(p_logprobs: dict[str, float], q_logprobs: dict[str, float]) -> float:
    """KL(p || q) over p's top tokens, q's missing ones at q's smallest logprob."""
    floor = min(q_logprobs.values())
    p = {k: math.exp(v) for k, v in p_logprobs.items()}
    q = {k: math.exp(q_logprobs.get(k, floor)) for k in p}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(pv / zp * math.log((pv / zp) / (q[k] / zq)) for k, pv in p.items())


def test_default_level_keeps_the_first_token_and_kl_bound(engine, sed_prompt, baseline):
    out = engine.ask(sed_prompt, kvcdn_quality="default")
    assert out["num_cached_tokens"] > 0
    assert out["token_ids"][0] == baseline["token_ids"][0]
    kl = _kl(baseline["first_logprobs"], out["first_logprobs"])
    print(f"KL over the top-20 logprobs of the first token: {kl:.5f}")
    assert kl <= KL_BOUND


def _object_file(store_dir: Path, manifest, chunk: int, level: str) -> Path:
    return store_dir / manifest.chunks[chunk].objects[level].key


def _sed_manifest(store_dir: Path):
    from kvcdn import catalog

    return catalog.read_manifest(open_store(str(store_dir), create=False), "sed")


@pytest.fixture
def restore(store_dir):
    """Files a test damages in the shared store, put back afterwards."""
    saved: dict[Path, bytes | None] = {}

    def save(path: Path) -> Path:
        saved.setdefault(path, path.read_bytes() if path.exists() else None)
        return path

    yield save
    for path, data in saved.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)


def _answers_as_vllm(out: dict, own: dict) -> None:
    """A partly loaded prompt answers as vLLM's own prefill: the first token, and its
    distribution within KL_BOUND. (The whole greedy answer can part after a dozen or
    more tokens: the loaded blocks hold transformers' fp32 KV rounded to fp16, the
    rest vLLM's bf16, split into passes differently from vLLM's own run.)"""
    assert out["token_ids"][0] == own["token_ids"][0]
    assert _kl(own["first_logprobs"], out["first_logprobs"]) <= KL_BOUND


def _prefix_cache_holds_the_right_kv(engine, prompt, baseline) -> None:
    """Asked again without kvcdn and without clearing vLLM's prefix cache, the blocks it
    reuses give vLLM's own first token and distribution: nothing wrong entered the cache.
    (Later tokens may part: bf16 results depend on how a prompt is split into passes.)"""
    again = engine.ask(prompt, reset=False, kvcdn_load=False)
    assert again["num_cached_tokens"] > 0
    assert again["token_ids"][0] == baseline["token_ids"][0]
    assert _kl(baseline["first_logprobs"], again["first_logprobs"]) <= KL_BOUND


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_corrupted_object_is_recomputed_by_vllm(
    engine, store_dir, sed_prompt, baseline, restore, mode
):
    """vLLM recomputes what failed; a synchronous load's blocks are in the prefix cache
    from the start, and must hold the right KV after the recompute too."""
    manifest = _sed_manifest(store_dir)
    path = restore(_object_file(store_dir, manifest, 1, "fp16"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: the sha256 in the manifest no longer matches
    path.write_bytes(bytes(data))
    out = engine.ask(sed_prompt, kvcdn_quality="fp16", kvcdn_load_mode=mode)
    # chunk 0 loaded; vLLM was told the rest failed, and computed it
    outcome = out["kv_transfer_params"]["kvcdn"]
    assert (outcome["mode"], outcome["loaded_tokens"]) == (mode, 256)
    # a whole read checks the object's sha256; a layer-ordered (part) read each section's
    said = [line for line in engine.log.read_text().splitlines()
            if "does not match the size and sha256 its manifest records" in line
            or "fails its checksum" in line]  # fmt: skip
    assert said and all(VLLM_LINE.match(line) for line in said), said  # as vLLM's own lines
    _answers_as_vllm(out, baseline)
    _prefix_cache_holds_the_right_kv(engine, sed_prompt, baseline)


def test_tampered_manifest_is_refused(engine, store_dir, sed_prompt, baseline, restore):
    path = restore(store_dir / keys.manifest_key("sed", 1))
    doc = json.loads(path.read_bytes())
    doc["chunks"][3]["tokens"][5] = (doc["chunks"][3]["tokens"][5] + 1) % 1000
    path.write_text(json.dumps(doc))  # valid JSON, but the chunk hashes no longer follow
    out = engine.ask(sed_prompt, kvcdn_quality="fp16")
    assert out["num_cached_tokens"] == 0
    assert out["token_ids"] == baseline["token_ids"]
    assert "chunk hashes do not match its tokens" in engine.log.read_text()
    _prefix_cache_holds_the_right_kv(engine, sed_prompt, baseline)


def test_kv_of_another_model_is_refused(engine, model, store_dir, sed_prompt, baseline, restore):
    """The prefix index for this model pointed at a manifest of another model."""
    manifest_path = store_dir / keys.manifest_key("sed", 1)
    doc = json.loads(manifest_path.read_bytes())
    doc["document"]["name"], doc["model"]["fingerprint"] = "sed-other", "0" * 64
    doc["codec_profile"]["key"] = keys.profile_key("0" * 64, doc["codec_profile"]["sha256"])
    other = restore(store_dir / keys.manifest_key("sed-other", 1))
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text(json.dumps(doc))
    first = chain_hash(model.fingerprint, "", sed_prompt[:256])
    entry = restore(store_dir / keys.prefix_index_key(model.fingerprint, first))
    entry.write_bytes(pointer_bytes("sed-other", 1))
    out = engine.ask(sed_prompt, kvcdn_quality="fp16")
    assert out["num_cached_tokens"] == 0
    assert out["token_ids"] == baseline["token_ids"]
    assert "sed-other@1, which starts with another chunk or is for another model" in (
        engine.log.read_text()
    )
    _prefix_cache_holds_the_right_kv(engine, sed_prompt, baseline)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_missed_deadline_leaves_the_document_to_vllm(engine, sed_prompt, baseline, mode):
    out = engine.ask(sed_prompt, kvcdn_quality="fp16", kvcdn_deadline_s=0.001,
                     kvcdn_load_mode=mode)  # fmt: skip
    outcome = out["kv_transfer_params"]["kvcdn"]
    assert outcome["mode"] == mode
    assert outcome["loaded_tokens"] < outcome["claimed_tokens"]
    assert out["token_ids"] == baseline["token_ids"]


def test_publish_with_vllm_loads_in_both_engines(engine, model, store_dir, tmp_path):
    """`kvcdn publish --engine vllm`, then the SDK with transformers and vLLM load it."""
    from kvcdn import sdk

    text = git_excerpt()
    doc = tmp_path / "git.txt"
    doc.write_text(text)
    store = store_dir  # the one the engine's connector reads
    env = _vllm_env()
    done = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "publish", str(doc), "--engine", "vllm",
         "--store", str(store), "--levels", "fp16,int8", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert parsed("publish", done.stdout)[0]["name"] == "git"
    # transformers reads vLLM's KV (bf16) back within bf16's rounding of its own
    ids = model.document_ids(text)
    reference = model.prefill(ids)
    with sdk.Client(store=str(store)) as client:
        context = client.load_context("git", quality="fp16", model=model)
        loaded = kv_from_cache(context.cache)
    assert loaded.shape == reference.shape
    error = ((loaded - reference).norm() / reference.norm()).item()
    print(f"vLLM's {ENGINE_DTYPE} prefill against transformers' fp32: relative error {error:.2e}")
    # the dtype publish picked is what vLLM computed in: float32 agrees to float32's
    # drift, bf16 to bf16's rounding (0.0095 measured)
    assert error < (1e-3 if ENGINE_DTYPE == "float32" else 0.02)
    answer = context.generate("What is git?", max_new_tokens=8)
    own = context.answer_with_prefill("What is git?", max_new_tokens=1)
    assert answer.token_ids[0] == own.token_ids[0]
    # and vLLM loads it back: its first token and distribution as from its own prefill
    # (later tokens may part: the capture ran the document alone, a bf16 pass of
    # another shape than the document with the question)
    prompt = _prompt(model, text, "What is git?")
    own = engine.ask(prompt, kvcdn_load=False)
    out = engine.ask(prompt, kvcdn_quality="fp16")
    assert out["kv_transfer_params"]["kvcdn"]["loaded_tokens"] >= 256
    assert out["token_ids"][0] == own["token_ids"][0]
    kl = _kl(own["first_logprobs"], out["first_logprobs"])
    print(f"vLLM-published fp16 into vLLM: KL of the first token {kl:.5f}")
    assert kl <= KL_BOUND


def test_publish_picks_float32_on_a_cpu_without_fast_bfloat16():
    """``--dtype auto`` is vLLM's own dtype on a GPU and where the CPU has oneDNN's
    bfloat16 kernels (AVX-512 BW/VL/DQ), float32 elsewhere; a dtype given is kept, an
    unknown one named."""
    from kvcdn.sdk.vllm import engine_dtype
    from kvcdn.sdk.vllm.producer import cpu_computes_bfloat16

    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if flags:
        assert cpu_computes_bfloat16() == ({"avx512bw", "avx512vl", "avx512dq"} <= flags)
    assert engine_dtype("auto", cuda=False) == ("auto" if cpu_computes_bfloat16() else "float32")
    assert engine_dtype("auto", cuda=True) == "auto"
    for given in ("float32", "bfloat16", "float16"):
        assert engine_dtype(given, cuda=False) == given
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        engine_dtype("fp8")
    # the CLI offers the same names (it lists them itself: it does not import vLLM)
    from kvcdn.cli.publish import publish as command
    from kvcdn.sdk.vllm.producer import ENGINE_DTYPES

    (option,) = (p for p in command.params if p.name == "engine_dtype")
    assert tuple(option.type.choices) == ENGINE_DTYPES


def _chat(base: str, text: str, question: str, **extra) -> tuple[list[str], float, int]:
    """Stream a chat completion as an app would; returns the streamed pieces, the seconds from
    sending the request to the first answer token, and the prompt tokens vLLM did
    not compute (``cached_tokens``)."""
    body = {
        "model": "kvcdn-model",
        "messages": [user_message(text, question)],
        "max_tokens": 8,  # the answers are compared on their first 4 pieces
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    started = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    cached = 0
    with urllib.request.urlopen(request, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    pieces.append(piece)
            usage = event.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert ttft is not None, "no answer token was streamed"
    return pieces, ttft, cached


def test_vllm_serve_through_edges_with_one_killed(model, moto_endpoint, tmp_path, sed_file):
    """`vllm serve` with the connector reading a store on S3 (moto) through two edge
    processes; one edge is killed between requests, and documents still load. vLLM's
    ``/metrics``, scraped over HTTP, counts what kvcdn did."""
    from kvcdn.catalog import read_manifest
    from kvcdn.models import model_folder
    from tests.edge_helpers import EdgeProcess, MotoOrigin

    origin = MotoOrigin(moto_endpoint, "kv")
    store = open_store(origin.url, endpoint_url=moto_endpoint)
    result = publish(sed_file, name="sed", model=model, store=store, levels="fp16,default")
    manifest = read_manifest(store, result.name, result.version)
    edges = [
        EdgeProcess(origin.url, tmp_path / f"edge{i}", moto_endpoint).start() for i in range(2)
    ]
    port = free_port()
    transfer = {
        "kv_connector": "KvcdnConnector",
        "kv_connector_module_path": "kvcdn.sdk.vllm",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "store": origin.url, "endpoint_url": moto_endpoint,
            "edges": [e.url for e in edges], "model": "smollm2-135m",
            "quality": "fp16",  # exact KV: the same greedy answer as vLLM's own prefill
            # a named tenant reading the same store without the edges
            "tenants": {ACME: {"store": origin.url, "endpoint_url": moto_endpoint,
                               "name": "acme"}},
        },
    }  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            # `vllm serve`, as vllm-cpu 0.32.0 can run it (its `vllm` command asks for the
            # version of a `vllm` distribution, which vllm-cpu is not named)
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", model_folder(None),
             "--served-model-name", "kvcdn-model", "--host", "127.0.0.1", "--port", str(port),
             "--block-size", "256", "--enforce-eager", "--max-model-len", "8192",
             "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
             "--dtype", ENGINE_DTYPE,
             "--kv-transfer-config", json.dumps(transfer)],
            stdout=out, stderr=subprocess.STDOUT, env=_vllm_env(),
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not start"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        text = sed_excerpt()
        shared = (_published_tokens(model) - 1) // 256 * 256
        for n, question in enumerate((QUESTION, "Which option edits files in place?")):
            if n == 1:
                edges[0].kill()  # the other edge, or the origin, serves what it served
            own, own_ttft, own_cached = _chat(base, text, question,
                                              kv_transfer_params={"kvcdn_load": False})  # fmt: skip
            got, ttft, cached = _chat(base, text, question)
            print(f"vllm serve, request {n + 1}: TTFT {ttft:.3f} s with kvcdn, "
                  f"{own_ttft:.3f} s with vLLM's prefill")  # fmt: skip
            assert own_cached == 0
            assert cached == shared
            # the answer starts as vLLM's own (fp16 KV from transformers' fp32 prefill
            # is not bf16-identical to vLLM's, so long greedy answers may part later)
            assert got[:4] == own[:4], ("".join(got), "".join(own))
        for salt, expect in ((ACME, shared), ("nobody's salt", 0)):
            got, _, cached = _chat(base, text, QUESTION, cache_salt=salt)
            assert cached == expect, salt
        _metrics_count_the_loads(base, manifest, shared, [e.url for e in edges])
    finally:
        server.terminate()  # its graceful shutdown overlaps the next tests, as a driver's
        _STOPPING.append(server)
        for edge in edges:
            edge.kill()


def _metrics_count_the_loads(base: str, manifest, shared: int, edges: list[str]) -> None:
    """Two unsalted requests loaded ``shared`` tokens at fp16 through the edges (or the
    origin), one of tenant acme from the store, and one whose salt no tenant has got
    nothing: vLLM's /metrics says so, with its own model and engine labels and each
    tenant's label; the requests sent with ``kvcdn_load: false`` were never looked up."""
    from prometheus_client.parser import text_string_to_metric_families

    chunks = shared // 256
    fp16_bytes = sum(c.objects["fp16"].bytes for c in manifest.chunks[:chunks])
    samples: list = []

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name
                   and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip

    deadline = time.monotonic() + 30
    while True:  # vLLM's metrics process records a step's stats after its output
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        samples[:] = [s for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name.startswith("kvcdn_")]  # fmt: skip
        if total("kvcdn_loaded_tokens_total") >= 3 * shared or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(s.labels.get("model_name") == "kvcdn-model" and s.labels.get("engine") == "0"
               for s in samples)  # fmt: skip
    assert {s.labels.get("tenant") for s in samples} == {"default", "acme", "unmapped"}
    assert total("kvcdn_lookups_total", tenant="default", result="hit") == 2
    assert total("kvcdn_lookups_total", tenant="acme", result="hit") == 1
    assert total("kvcdn_lookups_total", tenant="unmapped", result="refused",
                 reason="tenant") == 1  # fmt: skip
    assert total("kvcdn_lookups_total") == 4
    for tenant, loads in (("default", 2), ("acme", 1)):
        assert total("kvcdn_claimed_tokens_total", tenant=tenant) == loads * shared
        assert total("kvcdn_loaded_tokens_total", tenant=tenant) == loads * shared
        assert total("kvcdn_chunks_total", tenant=tenant, level="fp16") == loads * chunks
        assert total("kvcdn_read_bytes_total", tenant=tenant, level="fp16") == loads * fp16_bytes
        assert total("kvcdn_load_seconds_count", tenant=tenant) == loads
    assert total("kvcdn_chunks_total") == 3 * chunks
    sources = {s.labels["source"] for s in samples
               if s.name == "kvcdn_read_bytes_total" and s.labels["tenant"] == "default"}
    assert sources and sources <= {*edges, "origin"}
    assert {s.labels["source"] for s in samples if s.name == "kvcdn_read_bytes_total"
            and s.labels["tenant"] == "acme"} == {"store"}  # fmt: skip
    assert total("kvcdn_recomputed_chunks_total") == 0
    assert total("kvcdn_lookup_seconds_count", tenant="default") >= 1


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"stor": "/tmp/kv"}, "unknown kv_connector_extra_config keys"),
        ({"deadline_s": -1}, "deadline_s must be a positive number"),
        ({"deadline_s": float("nan")}, "deadline_s must be a positive number"),
        ({"lookup_ttl_s": True}, "lookup_ttl_s must be a positive number"),
        ({"edges": "http://127.0.0.1:1"}, "edges must be a list"),
        ({"chunk_tokens": 8}, "chunk_tokens"),
        ({"store": 5}, "store"),
        ({"load_mode": "fast"}, "load_mode must be one of auto, sync, async"),
        ({"layer_groups": 0}, "layer_groups must be an integer from 1"),
        ({"layer_groups": 2.5}, "layer_groups must be an integer from 1"),
        ({"tenants": ["salt"]}, "tenants must map cache salts"),
        ({"tenants": {"salt": {"stor": "/tmp/kv"}}}, r"tenant #1: unknown keys \['stor'\]"),
        ({"tenants": {"salt": {"edges": []}}}, "tenant #1: store must be"),
        ({"tenants": {"a": {"store": "/a"}, "b": {"store": "/b", "trust": 5}}},
         "tenant #2: trust must be a non-empty string"),
        ({"tenants": {"a": {"store": "/a", "name": "acme corp"}}}, "tenant #1: name must be"),
        ({"tenants": {"a": {"store": "/a", "name": "default"}}},
         "tenant #1: the name 'default' is taken"),
        ({"tenants": {"a": {"store": "/a", "name": "acme"}, "b": {"store": "/b", "name": "acme"}}},
         "tenant #2: the name 'acme' is taken"),
        # an empty value is a mistake (an unset template variable), never "no trust file"
        ({"store": "/a", "trust": ""}, "trust must be a non-empty string"),
        ({"tenants": {"a": {"store": "/a", "trust": ""}}}, "tenant #1: trust must be a non-empty"),
        ({"edges": [""]}, "edges must be a list of edge URLs"),
        ({"edges": ["edge-1:8080"]}, "edges: 'edge-1:8080' is not an edge URL"),
        ({"edges": ["http://ops:hunter2@edge-1:8080"]}, "carries no credentials"),
        ({"tenants": {"a": {"store": "/a", "name": "acme\n"}}}, "tenant #1: name must be"),
        ({"tenants": {"sha256:9F86D0": {"store": "/a"}}}, "must be 'sha256:' and the 64"),
        ({"tenants": {"SHA256: " + "0" * 64: {"store": "/a"}}}, "must be 'sha256:' and the 64"),
        ({"store": "/a", "require_expiry": True}, "require_expiry needs a trust file"),
        ({"store": "/a", "trust": "/t.pub", "require_expiry": 1}, "require_expiry must be true"),
        ({"tenants": {"a": {"store": "/a", "require_expiry": True}}},
         "tenant #1: require_expiry needs a trust file"),
        ({"store": "/a", "trust_state": "/s.json"}, "trust_state needs a trust file"),
        ({"store": "/a", "trust": "/t.pub", "trust_state": ""}, "trust_state must be a non-empty"),
        # document names belong to a store: one tenant's guide@7 would refuse another's guide@3
        ({"store": "/a", "trust": "/t.pub", "trust_state": "/s.json",
          "tenants": {"a": {"store": "/b", "trust": "/t.pub", "trust_state": "/x/../s.json"}}},
         "tenant #1: trust_state is the record of the main store too"),
        ({"store": "/a", "tenants": {"a": {"store": "/b", "trust": "/t.pub", "trust_state": "/s"},
                                     "b": {"store": "/c", "trust": "/t.pub", "trust_state": "/s"}}},
         "tenant #2: trust_state is the record of tenant #1 too"),
    ],
)
def test_connector_configuration_mistakes_are_named(extra, problem):
    """A mistake in kv_connector_extra_config disables kvcdn with this message in vLLM's
    log (the engine itself runs on)."""
    from kvcdn.errors import KvcdnError
    from kvcdn.sdk.vllm import ConnectorConfig

    with pytest.raises(KvcdnError, match=problem) as raised:
        ConnectorConfig.parse(extra)
    assert "hunter2" not in str(raised.value)
    ok = ConnectorConfig.parse({"store": "/tmp/kv", "deadline_s": 0.5, "lookup_ttl_s": 0})
    assert ok.deadline_s == 0.5 and ok.quality == "auto"


def test_no_two_tenants_share_a_record_of_seen_versions(tmp_path):
    """However the same file is named (a link, a hard link, another spelling), two
    tenants' ``trust_state`` are refused at start; a path no file can have is named."""
    from kvcdn.errors import KvcdnError
    from kvcdn.sdk.vllm import ConnectorConfig

    record = tmp_path / "seen.json"
    record.write_text("{}")
    (tmp_path / "link.json").symlink_to(record)
    os.link(record, tmp_path / "hard.json")

    def config(main: str, tenant: str) -> dict:
        tenants = {"a": {"store": "/b", "trust": "/t.pub", "trust_state": tenant}}
        return {"store": "/a", "trust": "/t.pub", "trust_state": main, "tenants": tenants}

    for other in ("link.json", "hard.json", "./sub/../seen.json", "seen.json.lock"):
        with pytest.raises(KvcdnError, match="tenant #1: trust_state is the record of the main"):
            ConnectorConfig.parse(config(str(record), str(tmp_path / other)))
    with pytest.raises(KvcdnError, match="tenant #1: trust_state is not a usable path"):
        ConnectorConfig.parse(config(str(record), "a\0b"))
    ConnectorConfig.parse(config(str(record), str(tmp_path / "other.json")))


def test_any_cache_salt_is_some_tenant_s_or_none_s():
    """vLLM's Python API passes a salt as it is given, lone surrogates included (its
    OpenAI server refuses them): such a salt is hashed as its code points are, so it
    maps to a tenant or to none and never raises into vLLM's scheduler."""
    from kvcdn.sdk.vllm.config import tenant_key, tenant_sources

    odd = "\ud800 salt"
    key = tenant_key(odd)
    assert key == hashlib.sha256(odd.encode("utf-8", "surrogatepass")).hexdigest()
    assert tenant_key("\ud800 salt") == key != tenant_key("\ud801 salt")
    assert set(tenant_sources({odd: {"store": "/a"}})) == {key}
    # a salt and the digest of it name the same tenant; any other case of the digest fails
    plain = tenant_key("acme")
    assert set(tenant_sources({f"sha256:{plain}": {"store": "/a"}})) == {plain}


def test_a_load_that_falls_short_reports_only_its_own_blocks():
    """What vLLM is told to recompute: from the block of the first token not loaded,
    within the claim; never a block of vLLM's own prefix-cache hit before the claim
    (other requests share those), even when the load began inside a chunk (vLLM had
    its first 64 tokens) and failed in that chunk, stopping at its start."""
    from kvcdn.sdk.vllm import unfilled_blocks

    blocks = [10, 11, 12, 13, 14, 15, 16, 17]  # blocks of 64 tokens, chunks of 256
    assert unfilled_blocks(blocks, 0, 512, 512, 64) == set()
    assert unfilled_blocks(blocks, 0, 512, 256, 64) == {14, 15, 16, 17}
    assert unfilled_blocks(blocks, 64, 512, 0, 64) == {11, 12, 13, 14, 15, 16, 17}
    assert unfilled_blocks(blocks, 128, 448, 256, 64) == {14, 15, 16}
    assert unfilled_blocks(blocks, 0, 512, 300, 64) == {14, 15, 16, 17}  # mid-block
    # a start inside a block (not vLLM's: it caches whole blocks) keeps that block
    assert unfilled_blocks(blocks, 100, 512, 0, 64) == {11, 12, 13, 14, 15, 16, 17}


# ---- loads that cannot make a request much slower than vLLM without kvcdn ----------


@pytest.fixture(scope="module")
def other_prompt(model) -> list[int]:
    """A plain request beside a kvcdn one: another document, which kvcdn does not serve."""
    text = read_document(REPO / "kvcdn" / "data" / "calibration" / "git.txt")[:4000]
    return _prompt(model, text, "What is git?")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_object_that_blocks_its_reader_does_not_hold_the_engine(
    engine, store_dir, sed_prompt, other_prompt, restore, mode
):
    """A FIFO in an object's place (what a hung NFS or FUSE mount is to ``open()``):
    before, the request and a plain request beside it took 78 s; the object is now
    refused at once, its chunk and the rest left to vLLM."""
    alone = engine.ask(sed_prompt, kvcdn_load=False, beside=[other_prompt])
    path = restore(_object_file(store_dir, _sed_manifest(store_dir), 1, "fp16"))
    path.unlink()
    os.mkfifo(path)
    try:
        out = engine.ask(sed_prompt, kvcdn_quality="fp16", kvcdn_load_mode=mode,
                         beside=[other_prompt])  # fmt: skip
    finally:
        path.unlink()  # (restore writes the object back)
    outcome = out["kv_transfer_params"]["kvcdn"]
    print(f"{mode}: {out['seconds']:.2f} s with a FIFO object, {alone['seconds']:.2f} s "
          f"without kvcdn; budget {outcome['deadline_s']:.2f} s")  # fmt: skip
    assert (outcome["mode"], outcome["loaded_tokens"]) == (mode, 256)
    assert out["seconds"] <= alone["seconds"] + outcome["deadline_s"] + 1.0
    _answers_as_vllm(out, alone)
    assert out["beside"][0]["token_ids"] == alone["beside"][0]["token_ids"]
    assert "is not a regular file" in engine.log.read_text()


def test_an_edge_that_never_answers_costs_one_budget_then_is_skipped(
    engine, sed_prompt, other_prompt, model
):
    """A tenant whose edge accepts connections and never answers: its first load costs
    the load's budget (what it lacks then is left to vLLM), then the edge's circuit is
    open and the tenant's loads read the store at once. The connector loads this
    tenant's documents asynchronously (``auto``: its source is not local), where the
    engine's own store, a local folder, is loaded synchronously."""
    alone = engine.ask(sed_prompt, kvcdn_load=False, beside=[other_prompt])
    # a budget of its own, shorter than the edge's 30 s read timeout: the budget vLLM's
    # own prefill gets by default exceeds it on a slow CPU, and the store is then read
    # in time, after the timeout (on an AVX2-only host in bfloat16: everything loaded)
    first = engine.ask(sed_prompt, kvcdn_quality="fp16", beside=[other_prompt],
                       cache_salt=BEHIND_A_HANGING_EDGE, kvcdn_deadline_s=2.0)  # fmt: skip
    outcome = first["kv_transfer_params"]["kvcdn"]
    print(f"through a hanging edge: {first['seconds']:.2f} s, {alone['seconds']:.2f} s "
          f"without kvcdn; budget {outcome['deadline_s']:.2f} s, "
          f"{outcome['loaded_tokens']} of {outcome['claimed_tokens']} tokens loaded")  # fmt: skip
    # before: 30 s per object before the store was tried (61 s, then 31 s)
    assert outcome["mode"] == "async" and outcome["loaded_tokens"] < outcome["claimed_tokens"]
    # two prefills of the same prompt differ by a few percent on a slow CPU (once 21.5 s
    # against 18.3 s alone plus the 2 s budget): that much slack, far below the edge's 30 s
    assert first["seconds"] <= 1.1 * alone["seconds"] + outcome["deadline_s"] + 1.0
    _answers_as_vllm(first, alone)
    assert first["beside"][0]["token_ids"] == alone["beside"][0]["token_ids"]
    # its circuit is open now: the next loads read the store, whole, and answer as vLLM's
    # own prefill of the prompt alone (vLLM's bf16 answer depends on the batch a prompt
    # shares: alone is the comparison for a request alone). Where vLLM's prefills outlast
    # the circuit's 5 s (a slow CPU), the next load probes the edge first, for at most
    # 2 s, not the load's budget
    own = engine.ask(sed_prompt, kvcdn_load=False)
    for _ in range(2):  # and stays open
        out = engine.ask(sed_prompt, kvcdn_quality="fp16", cache_salt=BEHIND_A_HANGING_EDGE)
        outcome = out["kv_transfer_params"]["kvcdn"]
        assert outcome["loaded_tokens"] == outcome["claimed_tokens"] > 0, outcome
        assert out["token_ids"] == own["token_ids"]


# ---- models kvcdn cannot serve: refused at start, and said so --------------------------


def test_attention_kvcdn_cannot_hold_is_named():
    """Latent attention, sliding windows, hybrid layer kinds: each named; a Qwen2-style
    config that declares a window it does not use is served."""
    from transformers import DeepseekV2Config, Gemma2Config, LlamaConfig, Qwen2Config

    from kvcdn.models import unsupported_attention

    assert unsupported_attention(LlamaConfig()) is None
    assert unsupported_attention(Qwen2Config(use_sliding_window=False)) is None
    assert "latent attention" in unsupported_attention(DeepseekV2Config(kv_lora_rank=512))
    assert "mixes layer kinds" in unsupported_attention(Gemma2Config())
    from transformers import MistralConfig

    assert "sliding window of 128" in unsupported_attention(MistralConfig(sliding_window=128))


def test_a_sliding_window_model_is_refused_at_start_and_vllm_serves_alone(
    tmp_path_factory, model
):
    """A Mistral-architecture model attending within a 128-token window: the connector
    refuses it at start with one line naming why, on the scheduler and the worker, and
    vLLM answers every request itself (nothing claimed, no load, no recovery)."""
    import shutil

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from kvcdn.models import model_folder

    folder = tmp_path_factory.mktemp("windowed")
    source = Path(model_folder("smollm2-135m"))
    tokenizer = model.tokenizer
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=128,
        max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    store = tmp_path_factory.mktemp("windowed-store")
    extra = {"store": str(store), "model": str(folder), "lookup_ttl_s": 0}
    prompt = list(range(1000, 1600))
    with _engine(tmp_path_factory.mktemp("vllm-windowed"), str(folder), extra) as engine:
        out = engine.ask(prompt)
    assert len(out["token_ids"]) == 32 and not (out["kv_transfer_params"] or {}).get("kvcdn")
    said = [line for line in engine.log.read_text().splitlines()
            if "kvcdn connector disabled" in line]  # fmt: skip
    assert said and all("sliding window of 128 tokens" in line for line in said), said
    assert all(VLLM_LINE.match(line) for line in said), said
