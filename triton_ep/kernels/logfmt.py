"""LogFMT-10: how a low-latency combine with ``use_logfmt=True`` encodes the rows it returns (DeepEP's LogFMT-10,
``csrc/kernels/internode_ll.cu``), as Triton helpers the combine kernels inline (:mod:`.ll_combine`).

Per row and per block of 128 channels (the record layout: :func:`triton_ep.protocol.ll_area.logfmt_record_words`),
10 bits a channel, a 9-bit code and the sign:

- the scale word: the bf16 bits of the block's largest magnitude ``amax`` (low half) and smallest ``amin`` (high
  half), magnitudes of exponent 0 (zeros and subnormals) counting as 0;
- a block with ``amax < 1`` and ``amin < amax`` (DeepEP's condition for its LogFMT) is coded by the log of its
  magnitudes: ``lmax = log2(amax)``, ``lmin = max(log2(amin), lmax - 32)`` (``lmax - 32`` where ``amin`` is 0),
  the step ``s = (lmax - lmin) / 510``, a channel's code ``floor((log2|x| - lmin) / s + r)`` clamped to
  ``[0, 511]``, where ``r = 1.5 - s ln2 / 8`` puts the boundary between two codes at the arithmetic mean of the
  values they decode to (to second order in ``s``, DeepEP's rounding); decoded, code ``c`` is
  ``2 ** ((c - 1) * s + lmin)`` (0 below ``2 ** -126``): within half a step, ``2 ** (s / 2) - 1`` of the value, at
  most 2.2 % (``amin`` clipped 32 octaves under ``amax``), about 0.6 % for normal draws over 128 channels;
- any other block (a magnitude of 1 or more, or all magnitudes equal) linearly: code ``round(|x| * 511 / amax)``,
  decoded ``c * (amax / 511)``, within ``amax / 1022`` of the value;
- code 0 is 0 (with the sign), code 511 the block's ``amax`` exactly; a block whose ``amax`` is not finite (a NaN
  or an infinity in it) decodes to NaN in all its channels.

Where it differs from DeepEP's: DeepEP sends a group of 1024 channels (512 where ``hidden % 1024 != 0``) as bf16,
2 bytes a channel, when any block of it fails the condition, so its rows vary in size (up to ``2 * hidden`` plus
the scales); here the condition is per block and such a block is coded linearly, so every row is exactly
DeepEP's LogFMT-10 size, ``hidden * 10 / 8 + hidden / 128 * 4`` bytes. On DeepEP's accuracy measure
(``calc_diff`` of its tests, which adds 1 to every value) the linear blocks cost about twice what the bf16 rounding
costs (2.8e-6 against 1.4e-6 for normal draws of any scale over 1), against 1e-5 allowed. DeepEP's GPU
approximations (``lg2.approx``, ``ex2.approx``) are replaced by arithmetic every platform rounds alike: ``log2`` of
a bf16 magnitude as its exponent plus a 128-entry table of ``log2(1 + m / 128)`` (:func:`log2_table`), ``2 ** y``
as a degree-7 Taylor polynomial of ``2 ** f`` on ``[-0.5, 0.5]`` times powers of two, one fp32 operation at a
time (the kernels run without fused multiply-add), divisions correctly rounded. The interpreter (CPU), the GPU and
:func:`triton_ep.reference.logfmt_encode` / ``logfmt_decode`` agree bit for bit.
"""
import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..protocol.ll_area import LOGFMT_BLOCK, LOGFMT_BLOCK_WORDS


def _f32(v: float) -> float:
    """``v`` rounded to the nearest fp32 (as a Python float, exactly representable in fp32)."""
    return float(np.float32(v))


#: fp32 constants of the encoding (exact fp32 values, so the kernels and the reference round nothing more)
INV_STEPS = tl.constexpr(_f32(1.0 / 510.0))
ROUND_C = tl.constexpr(_f32(math.log(2.0) / 8.0))
_E = [_f32(math.log(2.0) ** k / math.factorial(k)) for k in range(8)]
E1, E2, E3, E4, E5, E6, E7 = (tl.constexpr(c) for c in _E[1:])
BLOCK = tl.constexpr(LOGFMT_BLOCK)
BLOCK_WORDS = tl.constexpr(LOGFMT_BLOCK_WORDS)

#: log2_table per device
_TABLES: dict = {}


def log2_table(device: torch.device) -> torch.Tensor:
    """fp32 ``[128]``: ``log2(1 + m / 128)`` rounded to fp32, the mantissa part of the log of a bf16 value
    (computed in float64 on the CPU). One tensor per device, made at its first use (a copy to the device: the
    low-latency state asks for it when it is built, outside any CUDA-graph capture)."""
    key = str(device)
    t = _TABLES.get(key)
    if t is None:
        m = torch.arange(128, dtype=torch.float64, device="cpu")
        t = _TABLES[key] = torch.log2(1.0 + m / 128.0).to(torch.float32).to(device)
    return t


def table_arg(use_logfmt: bool, placeholder: torch.Tensor) -> torch.Tensor:
    """A combine kernel's ``ltab`` argument: :func:`log2_table` on ``placeholder``'s device with ``use_logfmt``,
    else ``placeholder`` (not read)."""
    return log2_table(placeholder.device) if use_logfmt else placeholder


@triton.jit
def _log2_bits(m, ltab):
    """``log2`` of the bf16 magnitudes whose bits are ``m`` (int32, normal and finite), fp32."""
    return ((m >> 7) - 127).to(tl.float32) + tl.load(ltab + (m & 127))


@triton.jit
def block_scale(amax, amin, ltab):
    """A block's ``(lmin, s, 1 / s or 0)`` from its magnitude bits ``amax >= amin`` (int32 tensors, exponent-0
    magnitudes as 0)."""
    lmax = _log2_bits(tl.maximum(amax, 0x80), ltab)
    lmin = tl.where(amin == 0, lmax - 32.0, tl.maximum(_log2_bits(tl.maximum(amin, 0x80), ltab), lmax - 32.0))
    s = (lmax - lmin) * INV_STEPS
    inv = tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0)), 0.0)
    return lmin, s, inv


@triton.jit
def _log_mode(amax, amin):
    """Whether a block is encoded by the log of its magnitudes (DeepEP's condition: ``log2(amax) < 0`` and
    ``lmin < lmax``, i.e. ``amax < 1`` and ``amin < amax``), else linearly."""
    return (amax < 0x3F80) & (amin < amax)


@triton.jit
def encode(bits, ltab, ROWS: tl.constexpr):
    """Encode ``ROWS`` rows of one block: ``bits`` int32 ``[ROWS, 128]``, the bf16 bit patterns (0..65535).
    Returns the scale words int32 ``[ROWS]``, the code bytes ``[ROWS, 32]``, the ninth bits ``[ROWS, 4]`` and
    the sign bits ``[ROWS, 4]`` (int32 words, the record's order)."""
    mag = bits & 0x7FFF
    mag = tl.where(mag < 0x80, 0, mag)
    amax = tl.max(mag, axis=1)
    amin = tl.min(mag, axis=1)
    lmin, s, inv = block_scale(amax, amin, ltab)
    r = 1.5 - s * ROUND_C
    lx = _log2_bits(tl.maximum(mag, 0x80), ltab)
    u = (lx - lmin[:, None]) * inv[:, None] + r[:, None]
    lcode = tl.minimum(tl.floor(tl.maximum(u, 0.0)), 511.0)
    # linear: |x| * (511 / amax), rounded to nearest (ties up)
    finite = (amax > 0) & (amax < 0x7F80)
    af = tl.where(finite, (amax << 16).to(tl.float32, bitcast=True), 1.0)
    linv = tl.where(finite, tl.math.div_rn(tl.full(af.shape, 511.0, tl.float32), af), 0.0)
    xf = tl.where(mag < 0x7F80, (mag << 16).to(tl.float32, bitcast=True), 0.0)
    ncode = tl.minimum(tl.floor(xf * linv[:, None] + 0.5), 511.0)
    code = tl.where(_log_mode(amax, amin)[:, None], lcode, ncode).to(tl.int32)
    code = tl.where(mag == 0, 0, code)
    c = tl.arange(0, BLOCK)
    lo = tl.reshape((code & 255) << ((c % 4) * 8)[None, :], [ROWS, BLOCK // 4, 4])
    hi = tl.reshape(((code >> 8) & 1) << (c % 32)[None, :], [ROWS, BLOCK // 32, 32])
    sg = tl.reshape(((bits >> 15) & 1) << (c % 32)[None, :], [ROWS, BLOCK // 32, 32])
    # (the bits of each word are disjoint: their sum is their OR)
    return amax | (amin << 16), tl.sum(lo, axis=2), tl.sum(hi, axis=2), tl.sum(sg, axis=2)


@triton.jit
def _exp2(y):
    """``2 ** y`` for fp32 ``y`` in ``[-159, 130]`` (0 below ``2 ** -126``): ``2 ** f`` for ``f = y - round(y)``
    by its degree-7 Taylor polynomial (relative error under 1e-8), times ``2 ** round(y)`` in two powers of two."""
    n = tl.floor(y + 0.5)
    f = y - n
    p = f * E7
    p = (p + E6) * f
    p = (p + E5) * f
    p = (p + E4) * f
    p = (p + E3) * f
    p = (p + E2) * f
    p = (p + E1) * f
    p = p + 1.0
    ni = n.to(tl.int32)
    a = ni >> 1
    b = ni - a
    v = (p * ((a + 127) << 23).to(tl.float32, bitcast=True)) * ((b + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(y < -126.0, 0.0, v)


@triton.jit
def decode(meta, words, hi, sg, ltab, ROWS: tl.constexpr):
    """The fp32 values ``[ROWS, 128]`` of one block of ``ROWS`` records: its scale words ``meta`` int32
    ``[ROWS]``, code bytes ``words`` ``[ROWS, 32]``, ninth bits ``hi`` and signs ``sg`` ``[ROWS, 4]``."""
    amax = meta & 0xFFFF
    amin = (meta >> 16) & 0xFFFF
    lmin, s, _ = block_scale(amax, amin, ltab)
    af = (amax << 16).to(tl.float32, bitcast=True)
    c = tl.arange(0, BLOCK)
    wx = tl.reshape(tl.broadcast_to(words[:, :, None], [ROWS, BLOCK // 4, 4]), [ROWS, BLOCK])
    hx = tl.reshape(tl.broadcast_to(hi[:, :, None], [ROWS, BLOCK // 32, 32]), [ROWS, BLOCK])
    sx = tl.reshape(tl.broadcast_to(sg[:, :, None], [ROWS, BLOCK // 32, 32]), [ROWS, BLOCK])
    code = ((wx >> ((c % 4) * 8)[None, :]) & 255) | (((hx >> (c % 32)[None, :]) & 1) << 8)
    vlog = _exp2((code - 1).to(tl.float32) * s[:, None] + lmin[:, None])
    vlin = code.to(tl.float32) * tl.math.div_rn(af, tl.full(af.shape, 511.0, tl.float32))[:, None]
    v = tl.where(_log_mode(amax, amin)[:, None], vlog, vlin)
    v = tl.where(code == 511, af[:, None], v)
    v = tl.where(code == 0, 0.0, v)
    v = tl.where(((sx >> (c % 32)[None, :]) & 1) != 0, -v, v)
    nan = tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((amax >= 0x7F80)[:, None], nan, v)


@triton.jit
def store_block(area_w, rec, b, m, bits, ltab, NB: tl.constexpr, ROWS: tl.constexpr):
    """Encode block ``b`` of ``ROWS`` rows (``bits`` int32 ``[ROWS, 128]``) into their records at words ``rec``
    (int64 ``[ROWS]``, of ``NB`` blocks each) of ``area_w``, rows where ``m``."""
    meta, words, hi, sg = encode(bits, ltab, ROWS)
    tl.store(area_w + rec + b, meta, mask=m)
    at = rec + NB + b * BLOCK_WORDS
    o32 = tl.arange(0, BLOCK // 4)
    o4 = tl.arange(0, BLOCK // 32)
    tl.store(area_w + at[:, None] + o32[None, :], words, mask=m[:, None])
    tl.store(area_w + at[:, None] + BLOCK // 4 + o4[None, :], hi, mask=m[:, None])
    tl.store(area_w + at[:, None] + BLOCK // 4 + BLOCK // 32 + o4[None, :], sg, mask=m[:, None])


@triton.jit
def load_block(area_w, rec, b, m, ltab, NB: tl.constexpr, ROWS: tl.constexpr):
    """The fp32 values ``[ROWS, 128]`` of block ``b`` of the records at words ``rec`` (int64 ``[ROWS]``, of ``NB``
    blocks each) of ``area_w``; 0 in rows not ``m``."""
    at = rec + NB + b * BLOCK_WORDS
    o32 = tl.arange(0, BLOCK // 4)
    o4 = tl.arange(0, BLOCK // 32)
    meta = tl.load(area_w + rec + b, mask=m, other=0)
    words = tl.load(area_w + at[:, None] + o32[None, :], mask=m[:, None], other=0)
    hi = tl.load(area_w + at[:, None] + BLOCK // 4 + o4[None, :], mask=m[:, None], other=0)
    sg = tl.load(area_w + at[:, None] + BLOCK // 4 + BLOCK // 32 + o4[None, :], mask=m[:, None], other=0)
    return decode(meta, words, hi, sg, ltab, ROWS)


@triton.jit
def _spread(v, ROWS: tl.constexpr, NBB: tl.constexpr):
    """``[ROWS]`` -> ``[ROWS * NBB]``: each entry ``NBB`` times in a row."""
    return tl.reshape(tl.broadcast_to(v[:, None], [ROWS, NBB]), [ROWS * NBB])


@triton.jit
def store_rows(area_w, xh, src, rec, m, b0, ltab, NB: tl.constexpr, ROWS: tl.constexpr, NBB: tl.constexpr):
    """Encode blocks ``b0 .. b0 + NBB - 1`` (those under ``NB``) of ``ROWS`` rows, the bf16 bits at ``xh + src``
    (``xh`` an int16 pointer, ``src`` int64 ``[ROWS]`` element offsets), into their records at words ``rec`` (int64
    ``[ROWS]``, of ``NB`` blocks) of ``area_w``, rows where ``m``: ``ROWS * NBB`` blocks at once."""
    M: tl.constexpr = ROWS * NBB
    ob = tl.arange(0, NBB) + b0
    bm = tl.reshape(tl.broadcast_to(ob[None, :], [ROWS, NBB]), [M])
    mm = _spread(m, ROWS, NBB) & (bm < NB)
    oc = tl.arange(0, BLOCK)
    bits = tl.load(xh + _spread(src, ROWS, NBB)[:, None] + bm[:, None] * BLOCK + oc[None, :], mask=mm[:, None],
                   other=0).to(tl.int32) & 0xFFFF
    store_block(area_w, _spread(rec, ROWS, NBB), bm, mm, bits, ltab, NB, M)


@triton.jit
def load_rows(area_w, rec, m, b0, ltab, NB: tl.constexpr, ROWS: tl.constexpr, NBB: tl.constexpr):
    """The fp32 values ``[ROWS, NBB * 128]`` of blocks ``b0 .. b0 + NBB - 1`` (all under ``NB``) of the records at
    words ``rec`` (int64 ``[ROWS]``) of ``area_w``; 0 in rows not ``m``."""
    M: tl.constexpr = ROWS * NBB
    ob = tl.arange(0, NBB) + b0
    bm = tl.reshape(tl.broadcast_to(ob[None, :], [ROWS, NBB]), [M])
    v = load_block(area_w, _spread(rec, ROWS, NBB), bm, _spread(m, ROWS, NBB), ltab, NB, M)
    return tl.reshape(v, [ROWS, NBB * BLOCK])

