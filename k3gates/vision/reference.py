"""MoonViT3d's input side in float64 (K3-SPEC.md section 9): the independent reference the
vision gates hold the integer kernels to. Written from the definitions, not from the kernels:
an unfold and a matrix product, PyTorch's bilinear resize with half-pixel centres, the MAE
sin/cos embedding, and RoPE as a rotation of each pair by an angle."""

from __future__ import annotations

import numpy as np

PATCH = 14
TABLE = 64


def unfold(pixels: np.ndarray) -> np.ndarray:
    """[H, W, 3] -> [gh gw, 588] patches, row-major over the grid, each read channel first."""
    h, w, c = pixels.shape
    gh, gw = h // PATCH, w // PATCH
    p = pixels[: gh * PATCH, : gw * PATCH].reshape(gh, PATCH, gw, PATCH, c)
    return p.transpose(0, 2, 4, 1, 3).reshape(gh * gw, c * PATCH * PATCH)


def patch_embed(pixels: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x w^T with x = (p - 128) / 128, the conv of stride 14 as a matrix product."""
    x = (unfold(pixels).astype(np.float64) - 128.0) / 128.0
    return x @ w.T


def _taps(n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i0, i1, lambda) per output index: source (i + 0.5) 64 / n - 0.5, clamped at 0."""
    s = np.maximum((np.arange(n_out) + 0.5) * (TABLE / n_out) - 0.5, 0.0)
    i0 = np.floor(s).astype(np.int64)
    return i0, np.minimum(i0 + 1, TABLE - 1), s - i0


def resize_bilinear(table: np.ndarray, h: int, w: int) -> np.ndarray:
    """[64, 64, D] -> [h w, D]: interpolate along y, then along x."""
    y0, y1, ly = _taps(h)
    x0, x1, lx = _taps(w)
    rows = table[y0] * (1 - ly)[:, None, None] + table[y1] * ly[:, None, None]  # [h, 64, D]
    out = rows[:, x0] * (1 - lx)[None, :, None] + rows[:, x1] * lx[None, :, None]
    return out.reshape(h * w, -1)


def time_frequencies(dim: int) -> np.ndarray:
    """w_i = 10000^(-i / (D/2)), i = 0 .. D/2 - 1 (radians per frame)."""
    return 10000.0 ** (-np.arange(dim // 2, dtype=np.float64) / (dim // 2))


def time_embed(frames: int, dim: int) -> np.ndarray:
    """[frames, D]: sin(t w) then cos(t w)."""
    angle = np.arange(frames, dtype=np.float64)[:, None] * time_frequencies(dim)[None, :]
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1)


def rope_frequencies(head: int) -> np.ndarray:
    """Per half of a head (head/2 values, head/4 pairs): 10000^(-2i / (head/2))."""
    half = head // 2
    return 10000.0 ** (-np.arange(0, half, 2, dtype=np.float64) / half)


def _rotate(x: np.ndarray, pos: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Pairs (i, i + n/2) of each row turned by the angle pos * freq[i], as complex numbers."""
    k = freq.shape[0]
    z = (x[:, :k] + 1j * x[:, k:]) * np.exp(1j * pos[:, None].astype(np.float64) * freq[None, :])
    return np.concatenate([z.real, z.imag], axis=1)


def rope2d(x: np.ndarray, pos_x: np.ndarray, pos_y: np.ndarray) -> np.ndarray:
    """[N, head]: the first half turned by the column, the second by the row."""
    half = x.shape[1] // 2
    freq = rope_frequencies(x.shape[1])
    return np.concatenate(
        [_rotate(x[:, :half], pos_x, freq), _rotate(x[:, half:], pos_y, freq)], axis=1
    )


# == the block, the merger and the projector: each stage on the integers it received ===========
def rmsnorm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """g x / sqrt(mean(x^2) + eps), row by row."""
    return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def gelu(x: np.ndarray) -> np.ndarray:
    """The tanh form: x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def scores(q: np.ndarray, keys: np.ndarray, head_dim: int) -> np.ndarray:
    """q . k_j / sqrt(head_dim) for one query row against its segment's keys."""
    return keys @ q / np.sqrt(head_dim)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def merge(x: np.ndarray, frames: int, chunk: int, gh: int, gw: int) -> np.ndarray:
    """Mean over each chunk's frames, zero padding to even sides, 2 x 2 groups concatenated."""
    d = x.shape[1]
    grid = x.reshape(frames, gh, gw, d)
    means = [grid[f : f + chunk].mean(axis=0) for f in range(0, frames, chunk)]
    out = []
    for m in means:
        padded = np.zeros((gh + gh % 2, gw + gw % 2, d))
        padded[:gh, :gw] = m
        groups = padded.reshape(padded.shape[0] // 2, 2, padded.shape[1] // 2, 2, d)
        out.append(groups.transpose(0, 2, 1, 3, 4).reshape(-1, 4 * d))
    return np.concatenate(out)
