"""The Triton decoder of the nested ladder, bit for bit against the CPU kernel, on streams
the real encoder made from the embedded model's KV with its calibrated profile.

Without a GPU the kernel runs in Triton's interpreter, in a child process (this file
run as a script: ``TRITON_INTERPRET=1`` only takes effect before Triton is first
imported), as in test_rans_triton.py. The interpreter is slow, so the streams are a few
groups and tokens; the ``gpu`` test decodes whole real objects through the codec.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcdn.kernels import nested
from kvcdn.kernels.rans import RansError
from tests.test_rans_triton import DTYPES, LAYOUTS, bits, output_buffer, output_view

GROUPS = np.array([0, 7, 61, 118, 179])  # not a multiple of a program's 8 groups
TOKENS = 4
ARRAYS = ("words", "wbeg", "wend", "states", "lut", "cum", "mean", "fine", "depth", "lo",
          "base", "refine", "stride")  # fmt: skip
CORRUPTIONS = ("flip_word", "truncate", "bad_state")


def make_case(profile, kv: torch.Tensor, lanes: slice) -> dict[str, np.ndarray]:
    """Real KV of a few groups (with values far outside the tables' range, and a NaN,
    which the encoder clips), coded by the real encoder with the real profile."""
    *arrays, stride = profile.nested_arrays()
    mean, fine, depth, lo, size, base, refine = (a[..., GROUPS, lanes] for a in arrays)
    G, D = mean.shape
    x = kv.float().numpy().reshape(-1, kv.shape[3], kv.shape[4])[GROUPS, :TOKENS, lanes].copy()
    x[0, 1, 3], x[1, 2, 5], x[2, 0, 7] = 1e4, -1e4, np.nan
    freqs = profile.freqs
    states, words, word_start = nested.encode(x, mean, fine, depth, lo, size, base, refine,
                                              stride, freqs)  # fmt: skip
    first = np.cumsum([0] + [len(w) for w in words])[:, None]  # each tier's words, joined
    return {
        "words": np.concatenate([*words, np.zeros(1, np.uint16)]),
        "wbeg": word_start[:, :-1] + first[:-1],
        "wend": word_start[:, 1:] + first[:-1],
        "states": states, "lut": profile.decode_tables(), "cum": profile.table_starts(),
        "mean": mean, "fine": fine, "depth": depth, "lo": lo, "base": base, "refine": refine,
        "stride": np.array(stride),
    }  # fmt: skip


def cpu_decode(case: dict[str, np.ndarray], k: int) -> np.ndarray:
    G, D = case["mean"].shape
    out = np.empty((G, TOKENS, D), dtype=np.float32)
    nested.decode(k, *(case[a] for a in ARRAYS), out)
    return out


def corrupt(case: dict[str, np.ndarray], how: str) -> dict[str, np.ndarray]:
    """``case`` with one defect in tier 2 of group 1, which the CPU kernel catches."""
    bad = {a: v.copy() for a, v in case.items()}
    if how == "truncate":
        bad["wend"][2, 1] -= 1
    elif how == "bad_state":
        bad["states"][2, 1, 0] ^= 1
    else:  # a flipped word is not always detectable (it may decode other symbols)
        for at in range(case["wbeg"][2, 1], case["wend"][2, 1]):
            bad["words"][at] = case["words"][at] ^ 0x5A5A
            try:
                cpu_decode(bad, 2)
            except RansError:
                return bad
            bad["words"][at] = case["words"][at]
        raise AssertionError("no detectable flip")  # pragma: no cover
    with pytest.raises(RansError):
        cpu_decode(bad, 2)
    return bad


# ---------------------------------------------------------------- child process


def _interpret(jobs: Path) -> None:
    """Decode each job with the interpreted kernel into every dtype and layout asked."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kvcdn.kernels import nested_triton

    nested_triton.warm_up("cpu", torch.bfloat16, 20)  # runs (its made-up stream is refused)
    for path in sorted(jobs.glob("*.in.npz")):
        job = dict(np.load(path))
        G, D = job["mean"].shape
        result: dict[str, np.ndarray] = {}
        for run in job["runs"]:
            k, dname, layout = int(run[0]), str(run[1]), str(run[2])
            big = output_buffer(layout, G, TOKENS, D, DTYPES[dname])
            view = output_view(big, layout, G, TOKENS, D)
            key = f"{k}_{dname}_{layout}"
            try:
                nested_triton.decode(k, *(job[a] for a in ARRAYS), view)
                result[f"{key}_raised"] = np.array(False)
            except RansError:
                result[f"{key}_raised"] = np.array(True)
            result[key] = view.float().numpy()  # exact for float16 / bfloat16
            inside = torch.zeros(big.shape, dtype=torch.bool)
            output_view(inside, layout, G, TOKENS, D).fill_(True)
            result[f"{key}_untouched"] = np.array(bool((big[~inside] == 7.0).all()))
        np.savez(str(path).replace(".in.npz", ".out.npz"), **result)


# ---------------------------------------------------------------- tests (parent)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory, profile, model, sed_text) -> dict:
    pytest.importorskip("triton")
    kv = model.prefill(model.document_ids(sed_text)[:40])[:, :, :, 8:]
    tiers = len(profile.nested.tiers)
    cases = {"all_lanes": make_case(profile, kv, slice(None)),
             "20_lanes": make_case(profile, kv, slice(5, 25))}  # fmt: skip
    top = [(tiers - 1, d, lay) for d in DTYPES for lay in LAYOUTS if d != "float32"]
    runs = {
        "all_lanes": [(k, "float32", "sliced") for k in range(tiers)] + top,
        "20_lanes": [(1, "float32", "permuted"), (tiers - 1, "bfloat16", "sliced")],
    }
    for how in CORRUPTIONS:
        cases[how] = corrupt(cases["all_lanes"], how)
        runs[how] = [(2, "float32", "sliced")]
    jobs = tmp_path_factory.mktemp("nested_triton")
    for name, case in cases.items():
        np.savez(jobs / f"{name}.in.npz", runs=np.array(runs[name], dtype=str), **case)
    root = str(Path(__file__).parents[1])  # the child imports this file's helpers as tests.*
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run([sys.executable, __file__, str(jobs)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    outputs = {name: dict(np.load(jobs / f"{name}.out.npz")) for name in cases}
    return {"cases": cases, "runs": runs, "outputs": outputs}


@pytest.mark.parametrize("case", ["all_lanes", "20_lanes"])
def test_interpreter_bit_exact_with_the_cpu_kernel(interpreted: dict, case: str) -> None:
    """Every tier, every output dtype and layout: the CPU kernel's values (rounded to the
    dtype as torch rounds), bit for bit, and nothing written outside the view."""
    data, result = interpreted["cases"][case], interpreted["outputs"][case]
    for k, dname, layout in interpreted["runs"][case]:
        key = f"{k}_{dname}_{layout}"
        assert not result[f"{key}_raised"], f"{key}: a valid stream was refused"
        assert result[f"{key}_untouched"], f"{key}: written outside the output view"
        want = torch.from_numpy(cpu_decode(data, int(k))).to(DTYPES[dname]).float().numpy()
        differ = np.argwhere(bits(result[key]) != bits(want))
        assert differ.size == 0, f"{key}: {len(differ)} values differ, first at {differ[0]}"


def test_the_cases_reach_every_tier_and_the_clipped_ends(interpreted: dict, profile) -> None:
    """The streams exercise what they should: each refinement codes some lanes (and not
    all: lanes of a tier are gathered), and the clipped values decode to the table ends."""
    case = interpreted["cases"]["all_lanes"]
    coded = case["depth"][1:] != case["depth"][:-1]
    assert coded.any(axis=(1, 2)).all() and not coded.all()
    top = cpu_decode(case, len(profile.nested.tiers) - 1)
    assert np.isfinite(top).all() and top[0, 1, 3] > top[0, :, 3].min()
    assert top[1, 2, 5] < top[1, :, 5].max()


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_interpreter_refuses_a_corrupt_stream(interpreted: dict, how: str) -> None:
    assert interpreted["outputs"][how]["2_float32_sliced_raised"]


def test_argument_checks() -> None:
    pytest.importorskip("triton")
    from kvcdn.kernels import nested_triton

    words = np.zeros(4, dtype=np.uint16)
    bounds = np.zeros((1, 1), dtype=np.int64)
    states = np.full((1, 1, nested.STATES), 1 << 16, dtype=np.uint32)
    empty = np.zeros((1, 4))
    wide = torch.empty(1, 2, 4, dtype=torch.float64)
    lut = np.zeros((1, 4096), dtype=np.uint32)
    depth = np.zeros((1, 1, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="out must be"):
        nested_triton.decode(0, words, bounds, bounds, states, lut, lut, empty, empty, depth,
                             empty, empty, empty, 0, wide)  # fmt: skip
    with pytest.raises(ValueError, match="outside the words"):
        nested_triton.decode(0, words, bounds, bounds + 5, states, lut, lut, empty, empty, depth,
                             empty, empty, empty, 0, torch.empty(1, 2, 4))  # fmt: skip
    with pytest.raises(ValueError, match="tiers 0..1"):
        nested_triton.decode(1, words, bounds, bounds, states, lut, lut, empty, empty, depth,
                             empty, empty, empty, 0, torch.empty(1, 2, 4))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decodes_real_objects_as_the_cpu_does(profile, model, sed_text) -> None:
    """Whole objects through the codec: into a CUDA tensor of each dtype (the Triton
    kernel), bit for bit the CPU's decode; a damaged tier is refused."""
    pytest.importorskip("triton")
    from kvcdn.codec import decode_chunk, decode_into, encode_chunk, nested_level
    from kvcdn.codecs import TensorDest
    from kvcdn.container import Part
    from kvcdn.errors import FormatError, IntegrityError

    kv = model.prefill(model.document_ids(sed_text)[:512]).float()
    level = nested_level("default", profile)
    for start in (0, 256):  # the first chunk has exact sink tokens
        obj = encode_chunk(level, kv[:, :, :, start:start + 256].contiguous(), "ab" * 32,
                           profile=profile, start=start)  # fmt: skip
        for k in range(len(profile.nested.tiers)):
            _, cpu = decode_chunk(obj, profile=profile, tiers=k + 1)
            part = Part.whole(cpu.shape[0], cpu.shape[2], k + 1)
            for dtype in DTYPES.values():
                gpu = torch.empty(cpu.shape, dtype=dtype, device="cuda")
                decode_into(obj, TensorDest(gpu), profile=profile, part=part)
                assert torch.equal(gpu.cpu(), cpu.to(dtype)), (start, k, dtype)
            wide = torch.zeros(*cpu.shape[:2], cpu.shape[2] + 2, *cpu.shape[3:], device="cuda")
            decode_into(obj, TensorDest(wide[:, :, 1:-1]), profile=profile, part=part)
            assert torch.equal(wide[:, :, 1:-1].cpu(), cpu) and not wide[:, :, 0].any()
    bad = bytearray(obj)
    bad[-100] ^= 0xFF  # the last tier's last section
    with pytest.raises((FormatError, IntegrityError)):
        decode_into(bytes(bad), TensorDest(torch.empty(cpu.shape, device="cuda")),
                    profile=profile, part=Part.whole(cpu.shape[0], cpu.shape[2], 6))  # fmt: skip


if __name__ == "__main__":  # the interpreter child process
    _interpret(Path(sys.argv[1]))
