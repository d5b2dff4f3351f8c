"""The Triton rANS decoder, bit for bit against the numpy reference and the numba kernel.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
which only takes effect if set before Triton is first imported), so those
runs happen in a child process: this file run as a script. The parent builds
real streams with the real encoders, the child decodes them with the Triton
kernel and hands its outputs back, and the parent compares them with
``decode_ref`` and the numba decoder. The ``gpu`` test runs the compiled
kernel on CUDA at a realistic size.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcdn.kernels import rans, rans_numba

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LAYOUTS = ("sliced", "permuted")
SENTINEL = 7.0  # written around the output views, must survive the decode
CORRUPTIONS = ("flip_word", "truncate", "shift_boundary", "bad_state")


def make_tables() -> np.ndarray:
    """Frequency tables ``[5, 256]``: the shapes that stress the coder."""
    k = np.arange(12)
    rows = [
        np.eye(1, 256, 3)[0] * 4096,  # one symbol, freq 4096: never renormalises
        np.pad(rans.normalize_freqs(np.exp(-np.abs(k - 5.5))), (0, 244)),  # ~2.5 bits
        rans.normalize_freqs(np.ones(256)),  # 8 bits: a word every other symbol
        np.pad(rans.normalize_freqs([1e6] + [1] * 19), (0, 236)),  # freq-1 symbols
        np.pad(rans.normalize_freqs([4095, 1]), (0, 254)),
    ]
    freqs = np.stack(rows).astype(np.uint32)
    rans.check_freqs(freqs)
    return freqs


def make_case(G: int, T: int, D: int, seed: int) -> dict[str, np.ndarray]:
    """Real symbols, encoded with the reference encoder, with dequantisation parameters."""
    rng = np.random.default_rng(seed)
    freqs = make_tables()
    n_tables = freqs.shape[0]
    table_id = rng.integers(0, n_tables, size=(G, D)).astype(np.int32)
    table_id[0, :n_tables] = np.arange(n_tables)  # every table in use
    sym = np.empty((G, T, D), dtype=np.uint8)
    for g in range(G):
        for d in range(D):
            f = freqs[table_id[g, d]].astype(np.float64)
            drawn = rng.choice(256, size=T, p=f / f.sum())
            rare = rng.choice(np.flatnonzero(f), size=T)  # rare symbols, often
            sym[g, :, d] = np.where(rng.random(T) < 0.15, rare, drawn)
    states, words, word_start = rans.encode_ref(sym, table_id, freqs)
    # Scales keep 4 significant bits (the codec's rule); offsets are arbitrary.
    scale = (rng.integers(8, 16, size=(G, D)) * 2.0 ** rng.integers(-9, -2, size=(G, D))).astype(
        np.float32
    )
    offset = rng.standard_normal((G, D)).astype(np.float32)
    # Lanes whose values fall exactly half-way between bfloat16 / float16 neighbours:
    # 1 + k/128 + 1/256 and 1 + k/1024 + 1/2048 (round-to-nearest-even decides).
    scale[:, -1], offset[:, -1] = 2.0**-7, 1 + 2.0**-8
    scale[:, -2], offset[:, -2] = 2.0**-7, -(1 + 2.0**-8)
    scale[:, -3], offset[:, -3] = 2.0**-10, 1 + 2.0**-11
    return {
        "sym": sym,
        "table_id": table_id,
        "freqs": freqs,
        "states": states,
        "words": words,
        "word_start": word_start,
        "lut": rans.build_decode_table(freqs),
        "scale": scale,
        "offset": offset,
    }


DECODE_ARGS = ("words", "word_start", "states", "lut", "table_id", "scale", "offset")


def numba_rejects(case: dict[str, np.ndarray]) -> bool:
    try:
        rans_numba.decode(*(case[k] for k in DECODE_ARGS), np.empty(case["sym"].shape, np.float32))
    except rans.RansError:
        return True
    return False


def corrupt(case: dict[str, np.ndarray], how: str) -> dict[str, np.ndarray]:
    """``case`` with one defect the decoders must catch.

    A flipped bit is not always detectable: a lane with the uniform 256-symbol
    table is a raw-bits channel, where a flip just decodes another symbol. So
    single flips go where the numba decoder does catch them (the tests then
    check that the reference and the Triton kernel catch them too).
    """
    ws = case["word_start"]
    if how in ("truncate", "shift_boundary"):
        case = {k: v.copy() for k, v in case.items()}
        if how == "truncate":
            case["words"] = case["words"][:-1]
            case["word_start"][-1] -= 1
        else:
            case["word_start"][2] += 1
        return case
    if how == "flip_word":
        sites = [("words", (k,), 0x5A5A) for k in range((ws[1] + ws[2]) // 2, ws[2])]
    elif how == "bad_state":
        sites = [("states", (1, d), 1) for d in range(case["states"].shape[1])]
    else:
        raise ValueError(how)
    for name, where, mask in sites:
        bad = {k: v.copy() for k, v in case.items()}
        bad[name][where] ^= mask
        if numba_rejects(bad):
            return bad
    raise AssertionError(f"no detectable {how} site")  # pragma: no cover


def reference(case: dict[str, np.ndarray]) -> np.ndarray:
    G, T, D = case["sym"].shape
    out = np.empty((G, T, D), dtype=np.float32)
    rans.decode_ref(*(case[k] for k in DECODE_ARGS), out)
    return out


def output_view(big: torch.Tensor, layout: str, G: int, T: int, D: int) -> torch.Tensor:
    """A strided ``[G, T, D]`` view of ``big`` (see :func:`output_buffer`)."""
    if layout == "sliced":  # a slice along T and every other lane
        return big[:, 2 : 2 + T, ::2]
    return big.permute(1, 0, 2)  # [T, G, D] storage


def output_buffer(layout: str, G: int, T: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (G, T + 5, 2 * D) if layout == "sliced" else (T, G, D)
    return torch.full(shape, SENTINEL, dtype=dtype)


# ---------------------------------------------------------------- child process


def _interpret(jobs_dir: Path, names: list[str]) -> None:
    """Decode every job with the interpreted kernel; write ``<name>.out.npz`` next to it."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kvcdn.kernels import rans_triton

    for name in names:
        case = dict(np.load(jobs_dir / f"{name}.npz"))
        G, T, D = case["sym"].shape
        args = rans_triton.to_device(*(case[k] for k in DECODE_ARGS), device="cpu")
        result: dict[str, np.ndarray] = {}
        for dname, dtype in DTYPES.items():
            for layout in LAYOUTS:
                big = output_buffer(layout, G, T, D, dtype)
                view = output_view(big, layout, G, T, D)
                try:
                    rans_triton.decode(*args, view)
                    raised = False
                except rans.RansError:
                    raised = True
                key = f"{dname}_{layout}"
                result[key] = view.float().numpy()  # exact for float16 / bfloat16
                result[f"{key}_raised"] = np.array(raised)
                outside = torch.ones(big.shape, dtype=torch.bool)
                output_view(outside, layout, G, T, D).fill_(False)
                result[f"{key}_untouched"] = np.array(bool((big[outside] == SENTINEL).all()))
                if raised:  # one dtype and layout is enough for a corrupt stream
                    break
            if case["expect_error"]:
                break
        np.savez(jobs_dir / f"{name}.out.npz", **result)


# ---------------------------------------------------------------- tests (parent)


INTERP_SHAPES = {"D64": (4, 24, 64), "D16_masked": (3, 20, 16)}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Cases, their reference decodes, and the interpreter's outputs for them."""
    pytest.importorskip("triton")
    jobs = tmp_path_factory.mktemp("rans_triton")
    cases = {}
    for i, (name, shape) in enumerate(INTERP_SHAPES.items()):
        cases[name] = make_case(*shape, seed=i)
    for how in CORRUPTIONS:
        cases[how] = corrupt(cases["D64"], how)
    for name, case in cases.items():
        np.savez(jobs / f"{name}.npz", expect_error=np.array(name in CORRUPTIONS), **case)
    env = dict(os.environ, TRITON_INTERPRET="1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, str(jobs), *cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    outputs = {name: dict(np.load(jobs / f"{name}.out.npz")) for name in cases}
    return {"cases": cases, "outputs": outputs, "seconds": time.perf_counter() - t0}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("shape_name", list(INTERP_SHAPES))
def test_interpreter_bit_exact(interpreted: dict, shape_name: str, dname: str, layout: str) -> None:
    case = interpreted["cases"][shape_name]
    result = interpreted["outputs"][shape_name]
    key = f"{dname}_{layout}"
    assert not result[f"{key}_raised"], "a valid stream was rejected"
    assert result[f"{key}_untouched"], "the kernel wrote outside its output view"
    ref = reference(case)
    nb = np.empty_like(ref)
    rans_numba.decode(*(case[k] for k in DECODE_ARGS), nb)
    np.testing.assert_array_equal(bits(nb), bits(ref))
    expected = torch.from_numpy(ref).to(DTYPES[dname]).float().numpy()
    got = result[key]
    mismatch = np.argwhere(bits(got) != bits(expected))
    assert mismatch.size == 0, (
        f"{len(mismatch)} values differ, first at {tuple(mismatch[0])}: "
        f"{got[tuple(mismatch[0])]!r} != {expected[tuple(mismatch[0])]!r}"
    )


def test_interpreter_cases_are_real(interpreted: dict) -> None:
    """The streams are what the encoders make, and exercise what they should."""
    case = interpreted["cases"]["D64"]
    states, words, word_start = rans_numba.encode(case["sym"], case["table_id"], case["freqs"])
    np.testing.assert_array_equal(states, case["states"])
    np.testing.assert_array_equal(words, case["words"])
    np.testing.assert_array_equal(word_start, case["word_start"])
    assert (case["table_id"] == 0).any() and (case["sym"] == 255).any()  # degenerate, 8-bit
    ref = reference(case)
    for col, ulp in ((-1, 2.0**-7), (-3, 2.0**-10)):  # exact ties were produced
        assert np.any((ref[:, :, col] - 1) % ulp == ulp / 2)


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_interpreter_corrupt_stream_raises(interpreted: dict, how: str) -> None:
    case = interpreted["cases"][how]
    with pytest.raises(rans.RansError):
        reference(case)
    with pytest.raises(rans.RansError):
        rans_numba.decode(*(case[k] for k in DECODE_ARGS), np.empty(case["sym"].shape, np.float32))
    assert interpreted["outputs"][how]["float32_sliced_raised"]


def test_to_device_and_argument_checks() -> None:
    pytest.importorskip("triton")
    from kvcdn.kernels import rans_triton

    case = make_case(2, 3, 16, seed=5)
    args = rans_triton.to_device(*(case[k] for k in DECODE_ARGS), device="cpu")
    assert [a.dtype for a in args] == [
        torch.int16,
        torch.int64,
        torch.int32,
        torch.int32,
        torch.int32,
        torch.float32,
        torch.float32,
    ]
    np.testing.assert_array_equal(args[0].numpy().view(np.uint16), case["words"])
    np.testing.assert_array_equal(args[2].numpy().view(np.uint32), case["states"])
    np.testing.assert_array_equal(args[3].numpy().view(np.uint32), case["lut"])
    out = torch.empty(2, 3, 16)
    with pytest.raises(ValueError, match="states"):
        rans_triton.decode(args[0], args[1], args[2].long(), *args[3:], out)
    with pytest.raises(ValueError, match="out"):
        rans_triton.decode(*args, out.double())
    assert rans_triton.available() == torch.cuda.is_available()
    # the words of an object are a read-only view of its bytes: copied quietly
    read_only = np.frombuffer(case["words"].tobytes(), dtype=np.uint16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = rans_triton.array_to_device(read_only, np.uint16, "cpu", np.int16)
    np.testing.assert_array_equal(on.numpy().view(np.uint16), case["words"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bit_exact_with_numba() -> None:
    pytest.importorskip("triton")
    from bench.codecbench.triton_decode import decode_throughput, synthetic
    from kvcdn.kernels import rans_triton

    G, T, D = 180, 256, 64
    sym, table_id, freqs = synthetic(G, T, D)
    tables = make_tables()  # add the stress tables to the realistic ones
    freqs = np.concatenate([np.pad(freqs, ((0, 0), (0, 256 - freqs.shape[1]))), tables])
    rng = np.random.default_rng(3)
    stress = rng.random((G, D)) < 0.25
    table_id = np.where(stress, 16 + rng.integers(0, len(tables), (G, D)), table_id)
    for g, d in np.argwhere(stress):
        f = freqs[table_id[g, d]].astype(np.float64)
        sym[g, :, d] = rng.choice(256, size=T, p=f / f.sum())
    case = {"table_id": table_id.astype(np.int32), "lut": rans.build_decode_table(freqs)}
    case["states"], case["words"], case["word_start"] = rans_numba.encode(sym, table_id, freqs)
    case["scale"] = (rng.integers(8, 16, (G, D)) / 256.0).astype(np.float32)
    case["offset"] = rng.standard_normal((G, D)).astype(np.float32)
    ref = np.empty((G, T, D), dtype=np.float32)
    rans_numba.decode(*(case[k] for k in DECODE_ARGS), ref)
    args = rans_triton.to_device(*(case[k] for k in DECODE_ARGS), device="cuda")
    for dname, dtype in DTYPES.items():
        for layout in LAYOUTS:
            big = output_buffer(layout, G, T, D, dtype).cuda()
            view = output_view(big, layout, G, T, D)
            rans_triton.decode(*args, view)
            expected = torch.from_numpy(ref).to(dtype).float().numpy()
            got = view.float().cpu().numpy()
            assert np.array_equal(bits(got), bits(expected)), f"{dname} {layout} differs"
    for how in CORRUPTIONS:
        bad = corrupt({**case, "sym": sym}, how)
        bad_args = rans_triton.to_device(*(bad[k] for k in DECODE_ARGS), device="cuda")
        with pytest.raises(rans.RansError):
            rans_numba.decode(*(bad[k] for k in DECODE_ARGS), np.empty((G, T, D), np.float32))
        with pytest.raises(rans.RansError):
            rans_triton.decode(*bad_args, torch.empty(G, T, D, device="cuda"))
    result = decode_throughput(G=G, T=T, D=D, iters=3)  # the codec bench's GPU figure
    assert result["gbps"] > 0 and 1.5 < result["bits_per_symbol"] < 4


if __name__ == "__main__":  # the interpreter child process
    _interpret(Path(sys.argv[1]), sys.argv[2:])
