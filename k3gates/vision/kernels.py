"""MoonViT3d's input side in integers (K3-SPEC.md section 9, figures per public ports): the patch
embedding, the learned position table resized to the patch grid, the frames' time embedding, 2D
RoPE, and the rule that counts the language-model tokens an image or a clip becomes.

Patch embedding. An image of H x W pixels (multiples of 14; the processor pads) is cut into 14 x 14
patches in row-major order; patch n's 588 values are read channel first (c, ky, kx), the layout of
a stride-14 convolution's weight [D, 3, 14, 14]. A pixel p in 0..255 enters as (p - 128) / 128,
which is exact in Q.7, so

    y[n, d] = sum_j x[n, j] w[d, j]        (x Q.7 exact, w Q.20, the sum exact in int64)

is rounded once to Q.16: error <= 1/2 LSB.

Position table. The learned 64 x 64 table T is resized bilinearly to an h x w patch grid with
half-pixel centres (PyTorch's align_corners=False): the source row of output row i is
s = (i + 1/2) 64/h - 1/2, clamped below at 0. With num = (2i + 1) 64 - h and den = 2h, s =
num/den exactly, so i0 = floor(s), i1 = min(i0 + 1, 63) and the fraction f = (num - i0 den)/den
are exact rationals, and

    P[i, j] = [(den_y - f_y)(den_x - f_x) T[i0, j0] + (den_y - f_y) f_x T[i0, j1]
               + f_y (den_x - f_x) T[i1, j0] + f_y f_x T[i1, j1]] / (den_y den_x)

(f_y, f_x now the integer numerators) has an exact integer numerator, divided once with rounding
(fx.div_round): error <= 1/2 LSB, at any grid size, smaller or larger than 64.

Time embedding. Frame t of a chunk (t = 0 .. 3) gets the fixed sin/cos embedding of width D (the
MAE convention, sin half first): E[t, i] = sin(t w_i), E[t, D/2 + i] = cos(t w_i), with w_i =
10000^(-i / (D/2)). The frequencies are per-model constants, derived exactly by the library face
(k3gates/fx/host.py) and handed in as Q0.62 turns per frame (k3gates.longctx.kernels' convention); the phase t f_i is
exact and sin/cos come from fx.sincos_q31 (Q0.31, error <= 1/2 + 2^-23 LSB), rounded once to Q.16:
error <= 1/2 + 2^-15 LSB.

2D RoPE. A head of 128 values is two halves of 64: the first half is turned by the patch's column
x, the second by its row y, each half in longctx's half-split layout (pairs (i, i + 32)) with the
frequencies 10000^(-2i/64), i = 0 .. 31. Both halves are longctx.kernels.rope_rotate, so its
formats and its error bound (rope_bound_q10) hold unchanged.

Token count. A frame of H x W pixels is padded to a 14 x 14 patch grid gh x gw = ceil(H/14) x
ceil(W/14), which the K2.5 processor limits to 512 per side and 16384 patches (beyond, it resizes
first; here such input is refused, -1); the 2 x 2 merge pads the grid to even sides; a clip's
frames are pooled in chunks of up to 4. Tokens = ceil(frames/4) ceil(gh/2) ceil(gw/2): one token
per 28 x 28 pixels per chunk.

Formats (int64 arithmetic):
    pixels          uint8 [H, W, 3]
    w (patch)       Q.20 int32 [D, 588], |w_raw| < 2^31: |x w| <= 2^7 2^31 = 2^38, and the sum
                    of 588 products below 2^47.2
    y (patch)       Q.16 int64 [gh gw, D], |y_raw| < 2^36.2 (no saturation)
    T (table)       Q.16 int32 [64, 64, D]; weights sum to den_y den_x <= 2^20 (h, w <= 512),
                    so every numerator is below 2^51
    P (positions)   Q.16 int64 [h w, D], within [min T, max T]
    f (time)        Q0.62 turns per frame, 0 <= f < 2^62
    E (time)        Q.16 int64 [frames, D], |E_raw| <= 2^16
    RoPE rows       Q.20 int32 [N, 128] (longctx.kernels: |x_raw| <= 2^30)
"""

import numpy as np

from ..fx.kernels import div_round, rshift_round, sincos_q31
from ..longctx.kernels import PHASE_BITS, phase_q62, rope_rotate

PATCH = 14  # pixels per patch side
PATCH_VALUES = 3 * PATCH * PATCH  # 588 values per patch, channel first
PIXEL_FRAC = 7  # (p - 128) / 128 in Q.7
PIXEL_ZERO = 128
W_FRAC = 20  # patch-embedding weights: Q.20
ACT_FRAC = 16  # embeddings: Q.16
TABLE = 64  # the learned position table is 64 x 64
HEAD = 128  # a head's width; RoPE turns 64 values by x and 64 by y
MERGE = 2  # the merger joins 2 x 2 patches
CHUNK = 4  # frames pooled per chunk
MAX_SIDE = 512  # patches per side (K2.5's processor)
MAX_PATCHES = 16384  # patches per frame (K2.5's processor)
SIN_SHIFT = 31 - ACT_FRAC  # Q0.31 sin/cos -> Q.16


# pythran export patch_embed(uint8[:,:,:] order(C), int32[:,:] order(C))
def patch_embed(pixels, w):
    """pixels [H, W, 3] uint8 with H, W multiples of 14, w [D, 588] Q.20: y [gh gw, D] Q.16
    (int64), row-major over the patch grid. Error <= 1/2 LSB."""
    gh, gw = pixels.shape[0] // PATCH, pixels.shape[1] // PATCH
    d_out = w.shape[0]
    y = np.zeros((gh * gw, d_out), dtype=np.int64)
    # omp parallel for
    for n in range(gh * gw):
        py, px = n // gw, n % gw
        x = np.zeros(PATCH_VALUES, dtype=np.int64)
        for c in range(3):
            for ky in range(PATCH):
                for kx in range(PATCH):
                    p = int(pixels[py * PATCH + ky, px * PATCH + kx, c])
                    x[(c * PATCH + ky) * PATCH + kx] = p - PIXEL_ZERO
        # y[n, d] = sum_j x[n, j] w[d, j], one rounding Q.27 -> Q.16
        for d in range(d_out):
            acc = 0
            for j in range(PATCH_VALUES):
                acc += x[j] * int(w[d, j])
            y[n, d] = rshift_round(acc, PIXEL_FRAC + W_FRAC - ACT_FRAC)
    return y


def _source(i, n_out):
    """The bilinear source of output index i of n_out from TABLE inputs, half-pixel centres:
    (i0, i1, f, den) with s = i0 + f/den exactly, clamped at 0 below and at TABLE - 1 above."""
    den = 2 * n_out
    num = max((2 * i + 1) * TABLE - n_out, 0)
    i0 = num // den
    f = num - i0 * den
    return i0, min(i0 + 1, TABLE - 1), f, den


# pythran export pos_resize(int32[:,:,:] order(C), int64, int64)
def pos_resize(table, h, w):
    """The TABLE x TABLE x D table (Q.16) resized bilinearly to h x w (1 <= h, w <= 512): P [h w,
    D] Q.16 (int64), row-major. Error <= 1/2 LSB (one rounding of an exact numerator)."""
    d_out = table.shape[2]
    out = np.zeros((h * w, d_out), dtype=np.int64)
    # omp parallel for
    for i in range(h):
        y0, y1, fy, dy = _source(i, h)
        for j in range(w):
            x0, x1, fx, dx = _source(j, w)
            # P = [(dy-fy)(dx-fx) T00 + (dy-fy) fx T01 + fy (dx-fx) T10 + fy fx T11] / (dy dx)
            w00, w01 = (dy - fy) * (dx - fx), (dy - fy) * fx
            w10, w11 = fy * (dx - fx), fy * fx
            for d in range(d_out):
                num = w00 * int(table[y0, x0, d]) + w01 * int(table[y0, x1, d])
                num += w10 * int(table[y1, x0, d]) + w11 * int(table[y1, x1, d])
                out[i * w + j, d] = div_round(num, dy * dx)
    return out


# pythran export time_embed(int64[:], int64)
def time_embed(freq, frames):
    """E [frames, 2 len(freq)] Q.16 (int64): E[t, i] = sin(t w_i), E[t, D/2 + i] = cos(t w_i),
    freq[i] = w_i in Q0.62 turns per frame. Error <= 1/2 + 2^-15 LSB."""
    half = freq.shape[0]
    out = np.zeros((frames, 2 * half), dtype=np.int64)
    for t in range(frames):
        for i in range(half):
            # (sin, cos)(t w_i), the phase t f_i exact mod one turn
            s, c = sincos_q31(phase_q62(t, int(freq[i])), PHASE_BITS)
            out[t, i] = rshift_round(s, SIN_SHIFT)
            out[t, half + i] = rshift_round(c, SIN_SHIFT)
    return out


def _half(x, lo, half):
    """Columns lo .. lo + half of x as a C-contiguous int32 array (rope_rotate's layout)."""
    out = np.zeros((x.shape[0], half), dtype=np.int32)
    for p in range(x.shape[0]):
        for i in range(half):
            out[p, i] = x[p, lo + i]
    return out


# pythran export rope2d(int32[:,:] order(C), int64[:], int64[:], int64[:])
def rope2d(x, pos_x, pos_y, freq):
    """Rows x [N, 2 D_h] (Q.20): the first half turned to column pos_x, the second to row pos_y,
    freq [D_h / 2] in Q0.62 turns per position: (int32 [N, 2 D_h] Q.20, saturations)."""
    half = x.shape[1] // 2
    a, sat_a = rope_rotate(_half(x, 0, half), pos_x, freq, 1 << 30)
    b, sat_b = rope_rotate(_half(x, half, half), pos_y, freq, 1 << 30)
    out = np.zeros((x.shape[0], 2 * half), dtype=np.int32)
    for p in range(x.shape[0]):
        for i in range(half):
            out[p, i] = a[p, i]
            out[p, half + i] = b[p, i]
    return out, sat_a + sat_b


def _ceil_div(a, b):
    return (a + b - 1) // b


def vision_tokens(height, width, frames):
    """Language-model tokens for `frames` frames of height x width pixels; -1 when an input is
    not positive or the patch grid exceeds 512 per side or 16384 patches."""
    if height < 1 or width < 1 or frames < 1:
        return -1
    gh, gw = _ceil_div(height, PATCH), _ceil_div(width, PATCH)
    if gh > MAX_SIDE or gw > MAX_SIDE or gh * gw > MAX_PATCHES:
        return -1
    return _ceil_div(frames, CHUNK) * _ceil_div(gh, MERGE) * _ceil_div(gw, MERGE)


# pythran export vision_tokens_array(int64[:], int64[:], int64[:])
def vision_tokens_array(height, width, frames):
    """vision_tokens for each (height[k], width[k], frames[k])."""
    out = np.zeros(height.shape[0], dtype=np.int64)
    for k in range(height.shape[0]):
        out[k] = vision_tokens(int(height[k]), int(width[k]), int(frames[k]))
    return out
