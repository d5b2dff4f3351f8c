"""Sixteen 32-bit lanes as one numba value, for kernels that must gather (AVX-512 or AVX2).

numba has no vector types, and LLVM will not vectorise a table-driven decoder by
itself: for this host's CPU (which LLVM names ``rocketlake``) it emits no gather
instruction at all, even for an explicit ``llvm.masked.gather``, which it turns back
into sixteen scalar loads (LLVM tunes the Intel cores hit by the Gather Data Sampling
mitigation to prefer no gathers). A gather from L1 costs about a
seventh of those loads here (0.15 against 1.07 ns an element, measured with four
independent chains), so this module names the instructions itself: :data:`vec` is a
numba type whose LLVM value is ``<16 x i32>``, the arithmetic operators work on it
(lane by lane, unsigned, wrapping; an integer operand is broadcast), and
:func:`gather`, :func:`gather_pair`, :func:`load`, :func:`store`, :func:`select`,
:func:`put_values` are the memory and blend operations, each one instruction or a few.

On a host with AVX2 but not AVX-512 (AMD's Zen 2 and 3, Intel's client cores) the
sixteen lanes are two 256-bit registers and a gather is two eight-lane ``vpgatherdd``:
LLVM splits every other operation itself. The kernels' results do not depend on
which: the same operations on the same lanes.

Only where :data:`AVAILABLE`: the x86 gather intrinsics compile nowhere else, so
callers keep a scalar kernel for other hosts (and for a numba told to compile for
another CPU, ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``).

:data:`fvec` is sixteen float32 lanes, with :func:`fadd`, :func:`fsub`, :func:`fmul`,
:func:`ffma`, :func:`fsplat`, :func:`fload` and :func:`fstore`, for kernels whose sums must stay
in registers (LLVM keeps a numba array in memory, and will not block a loop over
tokens by itself). These are plain LLVM vector operations: they compile on every host, so
need no :data:`AVAILABLE`.

Indices are element indices into 1-D arrays, signed 32-bit in the instructions, so
callers keep every gathered array under 2^31 elements.

These operations are compiled into their callers, and numba's cache keys a cached
kernel on its own source file only: a change here must come with a change to the
kernels' files (a release changes every file), or their cached code stays the old.
"""

from __future__ import annotations

import operator

import llvmlite.binding as _llvm
import llvmlite.ir as ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, overload, register_model

W = 16  # lanes
_I8P = ir.PointerType(ir.IntType(8))
_I32 = ir.IntType(32)
_VT = ir.VectorType(_I32, W)
_VF = ir.VectorType(ir.FloatType(), W)
_VM = ir.VectorType(ir.IntType(1), W)
_ALL = ir.Constant(_VM, [1] * W)


def _host_gather() -> str | None:
    """The widest gather this host has: ``"avx512f"``, ``"avx2"`` or None."""
    if config.CPU_NAME or config.CPU_FEATURES:  # compiling for another CPU
        return None
    try:
        features = _llvm.get_host_cpu_features()
    except RuntimeError:  # features unknown on this host
        return None
    return next((name for name in ("avx512f", "avx2") if features.get(name)), None)


GATHER = _host_gather()
AVAILABLE = GATHER is not None


class _Lanes(types.Type):
    def __init__(self) -> None:
        super().__init__(name=f"u32x{W}")


vec = _Lanes()


@register_model(_Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _VT)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_VT, [value & 0xFFFFFFFF] * W)


def _broadcast(builder, value):
    undef = ir.Constant(_VT, ir.Undefined)
    first = builder.insert_element(undef, value, _I32(0))
    return builder.shuffle_vector(first, undef, ir.Constant(_VT, [0] * W))


def _is_operand(ty) -> bool:
    return isinstance(ty, (_Lanes, types.Integer, types.IntegerLiteral))


def _operand(context, builder, ty, value):
    if isinstance(ty, _Lanes):
        return value
    return _broadcast(builder, context.cast(builder, value, ty, types.uint32))


def _element_pointer(context, builder, arrty, arr, index, indexty, elem):
    """Pointer to element ``index`` of ``arr``'s data (counted from its first element,
    whatever its strides), typed ``elem``."""
    data = context.make_array(arrty)(context, builder, arr).data
    at = builder.gep(data, [context.cast(builder, index, indexty, types.intp)])
    return builder.bitcast(at, ir.PointerType(elem))


def _lanewise(op, emit):
    """A two-operand lane-wise intrinsic, and ``op`` (an ``operator`` function) on
    :data:`vec` where one is given."""

    @intrinsic
    def impl(typingctx, a, b):
        if not (_is_operand(a) and _is_operand(b)):
            return None

        def codegen(context, builder, sig, args):
            x = _operand(context, builder, sig.args[0], args[0])
            y = _operand(context, builder, sig.args[1], args[1])
            return emit(builder, x, y)

        return vec(a, b), codegen

    if op is not None:

        @overload(op)
        def _on_lanes(a, b):
            lanes = isinstance(a, _Lanes) or isinstance(b, _Lanes)
            if lanes and _is_operand(a) and _is_operand(b):
                return lambda a, b: impl(a, b)

    return impl


def _flag(predicate):
    """A comparison as 1 or 0 in each lane (unsigned)."""
    return lambda b, x, y: b.zext(b.icmp_unsigned(predicate, x, y), _VT)


_lanewise(operator.add, lambda b, x, y: b.add(x, y))
_lanewise(operator.sub, lambda b, x, y: b.sub(x, y))
_lanewise(operator.mul, lambda b, x, y: b.mul(x, y))
_lanewise(operator.and_, lambda b, x, y: b.and_(x, y))
_lanewise(operator.or_, lambda b, x, y: b.or_(x, y))
_lanewise(operator.xor, lambda b, x, y: b.xor(x, y))
_lanewise(operator.lshift, lambda b, x, y: b.shl(x, y))
_lanewise(operator.rshift, lambda b, x, y: b.lshr(x, y))
_lanewise(operator.lt, _flag("<"))
_lanewise(operator.le, _flag("<="))
_lanewise(operator.gt, _flag(">"))
_lanewise(operator.ne, _flag("!="))
sra = _lanewise(None, lambda b, x, y: b.ashr(x, y))  # shift right, keeping the sign
minimum = _lanewise(None, lambda b, x, y: b.select(b.icmp_unsigned("<", x, y), x, y))


@intrinsic
def select(typingctx, flag, a, b):
    """``a`` in the lanes where ``flag`` is not 0, else ``b``."""
    if not (isinstance(flag, _Lanes) and _is_operand(a) and _is_operand(b)):
        return None

    def codegen(context, builder, sig, args):
        where = builder.icmp_unsigned("!=", args[0], _const(0))
        x = _operand(context, builder, sig.args[1], args[1])
        y = _operand(context, builder, sig.args[2], args[2])
        return builder.select(where, x, y)

    return vec(flag, a, b), codegen


@intrinsic
def load(typingctx, arr, at):
    """``arr[at:at + W]`` (32-bit elements)."""

    def codegen(context, builder, sig, args):
        p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VT)
        return builder.load(p, align=4)

    return vec(arr, at), codegen


@intrinsic
def store(typingctx, arr, at, value):
    """``arr[at:at + W] = value`` (32-bit elements)."""

    def codegen(context, builder, sig, args):
        p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VT)
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()

    return types.none(arr, at, value), codegen


def _gather_dwords(builder, base, index, scale):
    """The 32-bit words at ``base + index * scale`` bytes (``vpgatherdd``: one of sixteen
    lanes, or two of eight)."""
    if GATHER == "avx512f":
        fnty = ir.FunctionType(_VT, [_VT, _I8P, _VT, _VM, _I32])
        name = "llvm.x86.avx512.mask.gather.dpi.512"
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        return builder.call(fn, [ir.Constant(_VT, ir.Undefined), base, index, _ALL, _I32(scale)])
    half = ir.VectorType(_I32, W // 2)
    fnty = ir.FunctionType(half, [half, _I8P, half, half, ir.IntType(8)])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx2.gather.d.d.256")
    every = ir.Constant(half, [-1] * (W // 2))  # a lane is gathered where its sign bit is set
    halves = []
    for first in (0, W // 2):
        lanes = ir.Constant(half, list(range(first, first + W // 2)))
        part = builder.shuffle_vector(index, ir.Constant(_VT, ir.Undefined), lanes)
        args = [ir.Constant(half, ir.Undefined), base, part, every, ir.IntType(8)(scale)]
        halves.append(builder.call(fn, args))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VT, list(range(W))))


@intrinsic
def gather(typingctx, arr, index):
    """``arr[index]`` in each lane, zero-extended (a 1-D array of 8-, 16- or 32-bit
    integers).

    An 8- or 16-bit element is read as the 32 bits at its place, and the rest dropped:
    the elements after it are read too, so a caller's index stays that far below the
    array's end (padding elements at the end, for one)."""
    if not (isinstance(arr, types.Array) and isinstance(index, _Lanes)):
        return None
    bits = arr.dtype.bitwidth
    if bits not in (8, 16, 32):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        got = _gather_dwords(builder, builder.bitcast(data, _I8P), args[1], bits // 8)
        return got if bits == 32 else builder.and_(got, _const((1 << bits) - 1))

    return vec(arr, index), codegen


@intrinsic
def gather_pair(typingctx, arr, index):
    """``arr[index] | arr[index + 1] << 16`` in each lane (a 1-D array of 16-bit
    integers): two elements in one read, so a caller's index stays below the array's
    last element."""
    if not (isinstance(arr, types.Array) and isinstance(index, _Lanes)
            and arr.dtype.bitwidth == 16):  # fmt: skip
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return _gather_dwords(builder, builder.bitcast(data, _I8P), args[1], 2)

    return vec(arr, index), codegen


@intrinsic
def put_values(typingctx, out, at, n, mean, scale, params_at):
    """``W`` float32 values at element ``at`` of ``out``'s data (any float32 array, its
    elements counted from its first): ``mean + float32(n) * scale``, ``n`` the lanes as
    signed integers, ``mean`` and ``scale`` ``W`` float32 from ``params_at`` of 1-D
    arrays. A multiply, then an add: two roundings, never fused."""

    def codegen(context, builder, sig, args):
        def params(k):
            return builder.load(
                _element_pointer(context, builder, sig.args[k], args[k], args[5], sig.args[5], _VF),
                align=4,
            )

        product = builder.fmul(builder.sitofp(args[2], _VF), params(4))
        value = builder.fadd(params(3), product)
        dest = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF)
        builder.store(value, dest, align=4)
        return context.get_dummy_value()

    return types.none(out, at, n, mean, scale, params_at), codegen


# Sixteen float32 lanes. Plain LLVM vector arithmetic, so these compile on any host
# (two or four registers where a register holds fewer lanes); no gather, no
# AVAILABLE to check. Each operation rounds each lane once, as float32 arithmetic
# does: a multiply and an add are two instructions, never fused.


class _Floats(types.Type):
    def __init__(self) -> None:
        super().__init__(name=f"f32x{W}")


fvec = _Floats()


@register_model(_Floats)
class _FloatsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _VF)


@intrinsic
def fsplat(typingctx, x):
    """``x`` (rounded to float32) in every lane."""
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        undef = ir.Constant(_VF, ir.Undefined)
        first = builder.insert_element(undef, value, _I32(0))
        return builder.shuffle_vector(first, undef, ir.Constant(_VT, [0] * W))

    return fvec(x), codegen


@intrinsic
def fload(typingctx, arr, at):
    """``arr``'s float32 elements ``at .. at + W`` (counted from its first)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF)
        return builder.load(p, align=4)

    return fvec(arr, at), codegen


@intrinsic
def fstore(typingctx, arr, at, value):
    """``arr``'s float32 elements ``at .. at + W`` (counted from its first) = ``value``."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
        return None
    if not isinstance(value, _Floats):
        return None

    def codegen(context, builder, sig, args):
        p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF)
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()

    return types.none(arr, at, value), codegen


def _floatwise(emit):
    """A two-operand lane-wise intrinsic on :data:`fvec`. A function, not an operator:
    every ``+`` a numba kernel types would try another overload."""

    @intrinsic
    def impl(typingctx, a, b):
        if not (isinstance(a, _Floats) and isinstance(b, _Floats)):
            return None

        def codegen(context, builder, sig, args):
            return emit(builder, args[0], args[1])

        return fvec(a, b), codegen

    return impl


fadd = _floatwise(lambda b, x, y: b.fadd(x, y))
fsub = _floatwise(lambda b, x, y: b.fsub(x, y))
fmul = _floatwise(lambda b, x, y: b.fmul(x, y))


@intrinsic
def ffma(typingctx, a, b, c):
    """``a * b + c`` in each lane, rounded once (a fused multiply-add: LLVM's
    ``llvm.fma``, one instruction where the CPU has FMA, else libm's exact ``fmaf``)."""
    if not all(isinstance(x, _Floats) for x in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{W}f32")
        return builder.call(fn, args)

    return fvec(a, b, c), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` of three float32 scalars, rounded once to float32 (:func:`ffma`'s
    one lane)."""
    if not all(x == types.float32 for x in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen
