"""FP8 (e4m3) block quantisation, as low-latency dispatch casts its rows: one scale per 128 channels.

For each token row and each block of 128 channels (semantics of DeepEP's low-latency dispatch):

1. ``amax = max(|x|)`` over the block, floored at ``1e-4`` (an all-zero block keeps a finite scale);
2. the scale (what DeepEP returns, the *inverse* scale: ``x ~= q * scale``) is ``amax / 448``, or with
   ``round_scale`` the next power of two up, ``2 ** ceil(log2(amax / 448))``;
3. ``q = e4m3(x / scale)``, rounded to nearest even; ``|x / scale| <= 448`` by construction, so nothing
   saturates (a rounding overshoot is clamped to 448).

So ``|x - q * scale| <= amax / 16`` per element (half an e4m3 step is at most 2^-4 of the value), and
with ``round_scale`` the scales are powers of two, which UE8M0 stores as their exponent byte
(:func:`pack_ue8m0`).

On GPU the cast is Triton's ``float8e4nv`` conversion (round to nearest even, saturating). Triton's
interpreter does not round that cast correctly, so under it :func:`e4m3_bits` encodes the byte by integer
arithmetic (the same rounding). :func:`quantize_reference` is the same computation in PyTorch, the
oracle of the tests.
"""
import torch
import triton
import triton.language as tl

from . import names
from ._util import interpreted
from .launch import interpreter_turn

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)
BLOCK = 128


@triton.jit
def pow2_ceil(s):
    """The smallest power of two ``>= s`` for positive normal fp32 ``s`` (exact: exponent arithmetic)."""
    b = s.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """fp32 ``v`` with ``|v| <= 448`` -> its e4m3fn byte (int32 in [0, 255]), rounded to nearest even."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): keep 3 mantissa bits, round the 20 dropped ones to nearest even; a carry
    # moves into the exponent by itself.
    code = (((ab >> 23) - 127 + 7) << 3) | ((ab >> 20) & 7)
    rem = ab & 0xFFFFF
    code += ((rem > 0x80000) | ((rem == 0x80000) & ((code & 1) == 1))).to(tl.int32)
    # Subnormals (a < 2^-6): multiples of 2^-9; the scaled value is exact in fp32.
    t = a * 512.0
    q = t.to(tl.int32)                                   # floor (t >= 0)
    frac = t - q.to(tl.float32)
    q += ((frac > 0.5) | ((frac == 0.5) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a < 0.015625, q, code)
    return tl.where(a != a, 0x7F, sign | tl.minimum(code, 0x7E))       # NaN stays NaN (0x7F, as torch)


@triton.jit
def quantize_blocks(x, ROUND_SCALE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """Quantise an fp32 tile ``x`` ``[BLOCK_T, BLOCK_H]`` (``BLOCK_H`` a multiple of 128) by 128-channel
    blocks. Returns ``(q, scale)``: ``q`` ``[BLOCK_T, BLOCK_H]`` (fp8 e4m3 values with ``NATIVE``, else
    their bytes as int32) and ``scale`` fp32 ``[BLOCK_T, BLOCK_H // 128]``."""
    NB: tl.constexpr = BLOCK_H // 128
    xb = tl.reshape(x, [BLOCK_T, NB, 128])
    # A block holding a NaN gets a NaN scale and NaN values, as the reference (max() alone would skip it)
    has_nan = tl.max((xb != xb).to(tl.int32), axis=2) > 0
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), AMAX_FLOOR)
    amax = tl.where(has_nan, float("nan"), amax)
    # IEEE divisions (round to nearest): a GPU's default fp32 division is approximate (within 2 ulp), which
    # would make scales and bytes differ from the reference's now and then
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    if ROUND_SCALE:
        scale = tl.where(scale == scale, pow2_ceil(scale), scale)
    y = tl.math.div_rn(xb, tl.broadcast_to(scale[:, :, None], xb.shape))
    y = tl.where(y == y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX), y)      # clamp, keeping NaN
    if NATIVE:
        q = tl.reshape(y.to(tl.float8e4nv), [BLOCK_T, BLOCK_H])
    else:
        q = tl.reshape(e4m3_bits(y), [BLOCK_T, BLOCK_H])
    return q, scale


@names.jit('fp8_cast', do_not_specialize=['T'])
def _cast_kernel(x_ptr, q_ptr, s_ptr, T, H: tl.constexpr, ROUND_SCALE: tl.constexpr, NATIVE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    # Each program takes BLOCK_T rows and walks the row in BLOCK_H-channel tiles.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    mt = t < T
    for h0 in range(0, H, BLOCK_H):
        oh = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + t[:, None] * H + oh[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
        q, s = quantize_blocks(x, ROUND_SCALE, NATIVE, BLOCK_T, BLOCK_H)
        if NATIVE:
            tl.store(q_ptr + t[:, None] * H + oh[None, :], q, mask=mt[:, None])
        else:
            tl.store(q_ptr + t[:, None] * H + oh[None, :], q.to(tl.uint8), mask=mt[:, None])
        ob = h0 // 128 + tl.arange(0, BLOCK_H // 128)
        tl.store(s_ptr + t[:, None] * (H // 128) + ob[None, :], s, mask=mt[:, None])


def native_cast() -> bool:
    """Whether kernels use Triton's own e4m3 cast (compiled GPU code) rather than :func:`e4m3_bits`."""
    return not interpreted()


def quantize(x: torch.Tensor, round_scale: bool = False):
    """Quantise bf16 ``x`` ``[T, H]`` (``H % 128 == 0``) to ``(fp8 e4m3 [T, H], fp32 scales [T, H/128])``
    with the kernel (scales as DeepEP returns them: ``x ~= q * scale``). A standalone launcher of the
    cast low-latency dispatch fuses into its send (tests and benchmarks use it)."""
    T, H = x.shape
    if H % 128:
        raise ValueError(f"FP8 quantisation needs hidden % 128 == 0, got {H}")
    x = x.contiguous()
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, H // 128), dtype=torch.float32, device=x.device)
    native = native_cast()
    bh = 128
    while bh * 2 <= min(H, 1024) and H % (bh * 2) == 0:
        bh *= 2
    bt = 1 if native else 64
    if T:
        with interpreter_turn():
            _cast_kernel[(triton.cdiv(T, bt),)](x, q if native else q.view(torch.uint8), s, T, H=H,
                                                ROUND_SCALE=bool(round_scale), NATIVE=native, BLOCK_T=bt, BLOCK_H=bh)
    return q, s


def quantize_reference(x: torch.Tensor, round_scale: bool = False):
    """PyTorch oracle of :func:`quantize` (same formula, same rounding): ``(fp8 [T, H], fp32 [T, H/128])``."""
    T, H = x.shape
    xb = x.float().reshape(T, H // 128, 128)
    amax = xb.abs().amax(dim=2).clamp_min(1e-4)
    s = amax / 448.0
    if round_scale:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xb / s[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(T, H), s


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales ``[..., S]`` (``S % 4 == 0``) -> UE8M0 int32 ``[..., S/4]``: the exponent
    byte of scale ``c`` in byte ``c % 4`` (little end first) of word ``c // 4`` (DeepEP's packing)."""
    e = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    e = e.reshape(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    return (e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)).to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., S/4]`` -> fp32 ``[..., S]`` powers of two."""
    p = packed.to(torch.int64)
    e = torch.stack([(p >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 4)
    return (e.to(torch.int32) << 23).view(torch.float32)
