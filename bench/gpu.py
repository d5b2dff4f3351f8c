"""The GPU decode path on real objects: bit for bit the CPU's decode, and its speed.

    python bench/gpu.py prepare DIR [--tokens 1024] [--doc FILE]   # here, with the model
    python bench/gpu.py run DIR [--repeats 5] [--json OUT]          # on a CUDA machine

A GPU machine may have no copy of the model (the embedded model's package is larger
than what can be carried to a lent GPU), so the work is in two steps:

``prepare`` (any machine with the model): the embedded model's calibrated codec
profile, and real objects of a document that is not a calibration text (bash(1)
from character 60,000, as ``bench/codec.py``; ``--doc`` for another): its first
``--tokens`` tokens prefilled, each 256-token chunk encoded by the real encoder as
the nested ladder's one object and as the independent ladder's objects, the first
also as ``fp16`` and ``int8`` (large, and simple to decode). Each object's CPU
decode is hashed, so the machine that runs them can check its own CPU decode too.
Writes ``DIR/profile.bin``, ``DIR/objects/*`` and ``DIR/prepared.json``.

``run`` (a machine with a CUDA device and Triton):

* **bit for bit**: every object, every nested tier count, decoded through
  ``kvcdn.codec.decode_into`` into CUDA tensors of float32, float16 and bfloat16
  (and a strided view of a wider tensor, a tensor-parallel rank's heads, a pipeline
  stage's layers), equals the CPU decode cast to that dtype;
  the CPU decode there equals the one hashed at ``prepare``;
* **corrupt streams refused**: the nested kernel given a flipped word, a cut stream
  or a wrong final state (made as ``tests/test_nested_triton.py`` makes them, from
  this KV) raises, and an object with a flipped byte is refused before decoding;
* **speed**: each level's objects decoded into a float16 CUDA tensor (a reader's
  path: bytes already checked against their digests, host arrays copied to the
  device, the kernel, its end check), in fp16-equivalent GB/s (the KV's elements x 2
  bytes over the seconds), by 1, 4 and 16 threads, each on a CUDA stream of its own
  (a load decodes one chunk at a time: the 1-thread figure is what a reader meets);
  the same objects on the CPU kernels of that machine beside them (and the last GPU
  decodes, 16 threads at once, compared with theirs bit for bit); and the rANS
  kernel alone on synthetic streams (``bench/codecbench/triton_decode.py``).

Prints tables and writes JSON (``bench/results/gpu.json`` or ``--json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # the tests' case makers (after an installed kvcdn); bench/ is first

CHUNK = 256
THREADS = (1, 4, 16)  # decoding threads, each on a CUDA stream of its own
DEFAULT_JSON = REPO / "bench" / "results" / "gpu.json"


def _sha(t: Any) -> str:
    return hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------ prepare
def prepare(folder: Path, tokens: int, doc: Path | None) -> None:
    from codecbench.documents import gather_docs

    from kvcdn.codec import FIXED_LEVELS, decode_chunk, encode_chunk, ladder_level, nested_level
    from kvcdn.models import load_model
    from kvcdn.profile_store import ensure_profile
    from kvcdn.store import open_store

    model = load_model(None, "cpu")
    profile, _ = ensure_profile(open_store("memory://bench-gpu"), model)
    if profile.nested is None:
        raise SystemExit("the codec profile has no nested ladder: run 'kvcdn calibrate'")
    with tempfile.TemporaryDirectory() as tmp:
        name, path, origin = gather_docs([doc] if doc else None, Path(tmp))[0]
        text = path.read_text(encoding="utf-8")
    ids = model.document_ids(text)[: tokens - tokens % CHUNK]
    kv = model.prefill(ids).float()
    (folder / "objects").mkdir(parents=True, exist_ok=True)
    (folder / "profile.bin").write_bytes(profile.to_bytes())
    top = profile.nested.tiers[-1]
    levels = [("nested", nested_level(top, profile))]
    levels += [(n, ladder_level(n, profile)) for n in profile.levels]
    levels += list(FIXED_LEVELS.items())
    objects = []
    for c in range(len(ids) // CHUNK):
        chunk = kv[:, :, :, c * CHUNK : (c + 1) * CHUNK].contiguous()
        chunk_hash = hashlib.sha256(repr(ids[c * CHUNK : (c + 1) * CHUNK]).encode()).hexdigest()
        for label, level in levels if c == 0 else levels[: -len(FIXED_LEVELS)]:
            data = encode_chunk(level, chunk, chunk_hash, profile=profile, start=c * CHUNK)
            key = f"{label}-{c}"
            (folder / "objects" / key).write_bytes(data)
            tiers = len(profile.nested.tiers) if label == "nested" else None
            decoded = {}
            for k in range(1, (tiers or 1) + 1):
                _, out = decode_chunk(data, profile=profile, tiers=k if tiers else None)
                decoded[str(k)] = _sha(out.float())
            objects.append({"key": key, "level": label, "chunk": c, "bytes": len(data),
                            "tiers": tiers, "cpu_sha256": decoded})  # fmt: skip
    meta = {"model": model.name, "document": name, "origin": origin, "tokens": len(ids),
            "shape": list(kv.shape[:3]) + [CHUNK, kv.shape[4]],
            "tier_names": list(profile.nested.tiers), "objects": objects}  # fmt: skip
    (folder / "prepared.json").write_text(json.dumps(meta, indent=2))
    total = sum(o["bytes"] for o in objects)
    print(f"wrote {len(objects)} objects ({total / 1e6:.1f} MB) of {name} to {folder}")


# ---------------------------------------------------------------------------- run
class Prepared:
    """What ``prepare`` wrote: the profile, the objects and what they hold."""

    def __init__(self, folder: Path) -> None:
        from kvcdn.codec_profile import parse_profile

        self.meta = json.loads((folder / "prepared.json").read_text())
        self.profile = parse_profile((folder / "profile.bin").read_bytes())
        self.data = {o["key"]: (folder / "objects" / o["key"]).read_bytes()
                     for o in self.meta["objects"]}  # fmt: skip
        self.shape = tuple(self.meta["shape"])

    def of_level(self, level: str) -> list[dict[str, Any]]:
        return [o for o in self.meta["objects"] if o["level"] == level]

    def levels(self) -> list[str]:
        return list(dict.fromkeys(o["level"] for o in self.meta["objects"]))

    def readings(self) -> list[tuple[str, str, int | None]]:
        """(row name, level, tiers) of every level a reader can ask for."""
        rows: list[tuple[str, str, int | None]] = []
        for level in self.levels():
            if level == "nested":
                names = self.meta["tier_names"]
                rows += [(f"nested {n}", level, k + 1) for k, n in enumerate(names)]
            else:
                rows.append((level, level, None))
        return rows


def _part(shape: tuple[int, ...], tiers: int | None) -> Any:
    from kvcdn.container import Part

    return Part.whole(shape[0], shape[2], tiers)


def check_bits(p: Prepared) -> dict[str, Any]:
    """Every object and tier count: the GPU decode of each dtype equals the CPU's."""
    import torch

    from kvcdn.codec import decode_chunk, decode_into
    from kvcdn.codecs import TensorDest
    from kvcdn.container import Part

    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    checked, cpu_same, failures = 0, 0, []
    for o in p.meta["objects"]:
        data = p.data[o["key"]]
        for k in range(1, (o["tiers"] or 1) + 1):
            tiers = k if o["tiers"] else None
            _, cpu = decode_chunk(data, profile=p.profile, tiers=tiers)
            cpu_same += _sha(cpu.float()) == o["cpu_sha256"][str(k)]
            part = _part(p.shape, tiers)
            for dtype in dtypes:
                gpu = torch.empty(cpu.shape, dtype=dtype, device="cuda")
                decode_into(data, TensorDest(gpu), profile=p.profile, part=part)
                if not torch.equal(gpu.cpu(), cpu.to(dtype)):
                    failures.append(f"{o['key']} tiers={tiers} {dtype}")
                checked += 1
            wide = torch.zeros(*cpu.shape[:2], cpu.shape[2] + 2, *cpu.shape[3:], device="cuda")
            decode_into(data, TensorDest(wide[:, :, 1:-1]), profile=p.profile, part=part)
            if not (torch.equal(wide[:, :, 1:-1].cpu(), cpu.float()) and not wide[:, :, 0].any()):
                failures.append(f"{o['key']} tiers={tiers} strided")
            checked += 1
            for layers, heads in (((0, p.shape[0]), (1, 2)), ((10, 20), (0, p.shape[2]))):
                # a tensor-parallel rank's heads; a pipeline stage's layers
                (l0, l1), (h0, h1) = layers, heads
                rank = torch.empty(l1 - l0, 2, h1 - h0, *cpu.shape[3:], device="cuda")
                decode_into(data, TensorDest(rank), profile=p.profile,
                            part=Part(layers, heads, tiers))  # fmt: skip
                if not torch.equal(rank.cpu(), cpu[l0:l1, :, h0:h1].float()):
                    failures.append(f"{o['key']} tiers={tiers} part {layers} {heads}")
                checked += 1
    cases = sum(len(o["cpu_sha256"]) for o in p.meta["objects"])
    return {"decodes_compared": checked, "failures": failures,
            "cpu_decodes_equal_to_prepare": f"{cpu_same}/{cases}"}  # fmt: skip


def check_refusals(p: Prepared) -> dict[str, Any]:
    """The nested kernel on corrupt streams, and an object with a flipped byte."""
    import numpy as np
    import torch

    from kvcdn.codec import decode_chunk, decode_into
    from kvcdn.codecs import TensorDest
    from kvcdn.errors import FormatError, IntegrityError
    from kvcdn.kernels.nested_triton import decode as gpu_decode
    from kvcdn.kernels.rans import RansError
    from tests.test_nested_triton import (
        ARRAYS,
        CORRUPTIONS,
        GROUPS,
        TOKENS,
        corrupt,
        cpu_decode,
        make_case,
    )  # fmt: skip

    first = p.of_level("nested")[0]
    _, kv = decode_chunk(p.data[first["key"]], profile=p.profile)
    results: dict[str, Any] = {}
    for name, lanes in (("all_lanes", slice(None)), ("20_lanes", slice(7, 27))):
        case = make_case(p.profile, kv, lanes)
        same = True
        for k in range(len(p.meta["tier_names"])):
            out = torch.empty((len(GROUPS), TOKENS, case["mean"].shape[1]), device="cuda")
            gpu_decode(k, *(case[a] for a in ARRAYS), out)
            same &= bool(np.array_equal(out.cpu().numpy().view(np.uint32),
                                        cpu_decode(case, k).view(np.uint32)))  # fmt: skip
        results[f"kernel_bit_exact_{name}"] = same
    case = make_case(p.profile, kv, slice(None))
    for how in CORRUPTIONS:
        bad = corrupt(case, how)
        out = torch.empty((len(GROUPS), TOKENS, case["mean"].shape[1]), device="cuda")
        try:
            gpu_decode(2, *(bad[a] for a in ARRAYS), out)
            results[f"refused_{how}"] = False
        except RansError:
            results[f"refused_{how}"] = True
    bad = bytearray(p.data[first["key"]])
    bad[-100] ^= 0xFF  # the last tier's last section
    try:
        decode_into(bytes(bad), TensorDest(torch.empty(kv.shape, device="cuda")),
                    profile=p.profile, part=_part(p.shape, len(p.meta["tier_names"])))  # fmt: skip
        results["refused_flipped_object_byte"] = False
    except (FormatError, IntegrityError):
        results["refused_flipped_object_byte"] = True
    return results


def _timed(fn: Any, repeats: int, budget_s: float = 1.0) -> float:
    """Median seconds of ``repeats`` calls after a warm-up, fewer where they would take
    more than ``budget_s`` (a slow path must not use up a lent GPU's minutes)."""
    t = time.perf_counter()
    fn()  # warm-up: kernels compiled, memory allocated
    first = time.perf_counter() - t
    times = []
    for _ in range(max(1, min(repeats, int(budget_s / max(first, 1e-6))))):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def speed(p: Prepared, repeats: int) -> list[dict[str, Any]]:
    """Each level a reader can ask for: its objects decoded on the GPU (one thread; four
    threads, each on its own stream) and on this machine's CPU."""
    import torch

    from kvcdn.codec import warm_up

    warm_up("cuda", torch.float16, p.shape[4])
    return [_level_speed(p, row, level, tiers, repeats) for row, level, tiers in p.readings()]


def _decode_all(p: Prepared, data: list[bytes], outs: list[Any], tiers: int | None) -> None:
    from kvcdn.codec import decode_into
    from kvcdn.codecs import TensorDest

    part = _part(p.shape, tiers)
    for d, out in zip(data, outs, strict=True):
        decode_into(d, TensorDest(out), profile=p.profile, part=part, verified=True)


def _level_speed(p: Prepared, row: str, level: str, tiers: int | None,
                 repeats: int) -> dict[str, Any]:  # fmt: skip
    import torch

    data = [p.data[o["key"]] for o in p.of_level(level)] * 4  # work for every thread count
    per_chunk = int(torch.Size(p.shape).numel())
    elements = len(data) * per_chunk
    gpu_out = [torch.empty(p.shape, dtype=torch.float16, device="cuda") for _ in data]
    cpu_out = [torch.empty(p.shape, dtype=torch.float16) for _ in data]
    result = {"level": row, "chunks": len(data)}
    for n in THREADS:
        streams = [torch.cuda.Stream() for _ in range(n)]

        def work(i: int, streams: list[Any] = streams) -> None:
            with torch.cuda.stream(streams[i]):
                _decode_all(p, data[i :: len(streams)], gpu_out[i :: len(streams)], tiers)
            streams[i].synchronize()

        def threaded(streams: list[Any] = streams) -> None:
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(streams))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        seconds = _timed(threaded, repeats)
        result[f"gpu_{n}_threads_gbps"] = elements * 2 / seconds / 1e9
        if n == 1:
            result["gpu_ms_per_chunk"] = seconds / len(data) * 1e3
    cpu = _timed(lambda: _decode_all(p, data, cpu_out, tiers), max(1, repeats // 2))
    # the last GPU decodes (16 threads at once) against the CPU's: bit for bit
    pairs = zip(gpu_out, cpu_out, strict=True)
    result["gpu_equals_cpu"] = all(torch.equal(g.cpu(), c) for g, c in pairs)
    from kvcdn.codec import tier_bytes

    # What a reader of the level fetches: of a nested object, its index and k tiers.
    nbytes = sum(tier_bytes(d, tiers) if tiers else len(d) for d in data) / len(data)
    return {**result, "object_bytes": nbytes, "bits_per_element": nbytes * 8 / per_chunk,
            "cpu_gbps": elements * 2 / cpu / 1e9}  # fmt: skip


def _stage(what: str, fn: Any, failed: Any) -> Any:
    """``fn()``, or ``failed`` with the traceback printed: the other stages still run."""
    try:
        return fn()
    except Exception:
        import traceback

        print(f"{what} failed:", file=sys.stderr)
        traceback.print_exc()
        return failed


def run(folder: Path, repeats: int, out: Path, speed_only: bool = False) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py run needs a CUDA device")
    import triton
    from codecbench.triton_decode import decode_throughput

    from kvcdn.codecs.rans import triton_available

    if not triton_available():
        raise SystemExit("Triton cannot run here: the GPU decoders are unavailable")
    p = Prepared(folder)
    t = time.perf_counter()
    bits: dict[str, Any] = {"failures": [], "skipped": True}
    refusals: dict[str, Any] = {}
    if not speed_only:
        bits = _stage("bit for bit", lambda: check_bits(p), {"failures": ["did not run"]})
        refusals = _stage("refusals", lambda: check_refusals(p), {"ran": False})
    checks_s = time.perf_counter() - t
    rows = _stage("speed", lambda: speed(p, repeats), [])
    synthetic = _stage("synthetic", decode_throughput, {})
    import numba

    import kvcdn.kernels

    report = {
        "kvcdn": str(Path(kvcdn.kernels.__file__).parent.parent),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(), "prepared": {
            k: v for k, v in p.meta.items() if k != "objects"},
        "bit_exact": bits, "refusals": refusals, "checks_seconds": checks_s,
        "speed": rows, "rans_kernel_synthetic": synthetic,
    }  # fmt: skip
    print(f"kvcdn from {report['kvcdn']}")
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
          f"numba threads {report['numba_threads']}")  # fmt: skip
    print(f"bit for bit: {bits.get('decodes_compared', 0)} GPU decodes compared, "
          f"{len(bits['failures'])} differ {bits['failures'][:5]}; CPU decodes equal to "
          f"prepare's: {bits.get('cpu_decodes_equal_to_prepare')}")  # fmt: skip
    print("refusals and kernel checks:", refusals)
    heads = "".join(f"{f'GPU {n} thr GB/s':>17}" for n in THREADS)
    print(f"{'level':<22}{'bits/el':>8}{heads}{'ms/chunk':>10}{'CPU GB/s':>10}{'GPU/CPU':>9}")
    for r in rows:
        gpus = "".join(f"{r[f'gpu_{n}_threads_gbps']:>17.2f}" for n in THREADS)
        ratio = r["gpu_1_threads_gbps"] / r["cpu_gbps"]
        same = "" if r["gpu_equals_cpu"] else "  GPU != CPU"
        print(f"{r['level']:<22}{r['bits_per_element']:>8.2f}{gpus}"
              f"{r['gpu_ms_per_chunk']:>10.2f}{r['cpu_gbps']:>10.2f}{ratio:>8.1f}x"
              f"{same}")  # fmt: skip
    if synthetic:
        print(f"rANS kernel alone, synthetic {synthetic['G']}x{synthetic['T']}x"
              f"{synthetic['D']}: {synthetic['gbps']:.1f} GB/s fp16-equivalent")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    ok = not bits["failures"] and all(refusals.values()) and bool(rows)
    ok = ok and all(r["gpu_equals_cpu"] for r in rows)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    prep = sub.add_parser("prepare", help="real objects and a profile, where the model is")
    prep.add_argument("folder", type=Path)
    prep.add_argument("--tokens", type=int, default=1024)
    prep.add_argument("--doc", type=Path, help="a document (default: bash(1) from char 60,000)")
    go = sub.add_parser("run", help="bit-for-bit checks and speed on a CUDA device")
    go.add_argument("folder", type=Path)
    go.add_argument("--repeats", type=int, default=5)
    go.add_argument("--json", type=Path, default=DEFAULT_JSON)
    go.add_argument("--speed-only", action="store_true",
                    help="only the speed tables (of an older checkout, say)")  # fmt: skip
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.folder, args.tokens, args.doc)
        return 0
    return run(args.folder, args.repeats, args.json, args.speed_only)


if __name__ == "__main__":
    sys.exit(main())
