"""The ten canonical K3 innovations, their aliases, and the level ladder.

This is the one place that says which innovations exist. Every gate and every content page names
an innovation by id or alias; `canonical()` resolves it or raises, so a typo can never add an
eleventh row to the census or dilute its denominator.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Level(IntEnum):
    """The ladder (DESIGN.md): a score of 0..4."""

    GAP = 0  # no passing gate
    PARTIAL = 1  # building-block gates pass; the composed forward does not yet
    HAVE = 2  # the serve (inference forward) gate passes
    STRONG = 3  # the training form passes too: chunked form, backward, QAT or optimizer step
    PROVEN = 4  # a deterministic toy convergence run passes, bit-identical across two runs

    @classmethod
    def parse(cls, name: str) -> Level:
        """`"HAVE"` -> Level.HAVE; raises ValueError naming the valid levels."""
        try:
            return cls[name.strip().upper()]
        except (KeyError, AttributeError):
            valid = ", ".join(level.name for level in cls)
            raise ValueError(f"unknown level {name!r}; expected one of {valid}") from None


@dataclass(frozen=True)
class Innovation:
    id: str
    title: str
    short: str  # a few words for narrow table cells


INNOVATIONS: dict[str, Innovation] = {
    i.id: i
    for i in (
        Innovation("kda", "Kimi Delta Attention", "KDA"),
        Innovation("gatedmla", "Gated MLA (latent KV attention)", "Gated MLA"),
        Innovation("latentmoe", "Stable LatentMoE + Quantile Balancing", "LatentMoE + QB"),
        Innovation("situ", "SiTU activation (SiTU-GLU)", "SiTU"),
        Innovation("mxfp", "MXFP4 / MXFP8 weights and activations", "MXFP4/MXFP8"),
        Innovation("perheadmuon", "Per-Head Muon optimizer", "Per-Head Muon"),
        Innovation("attnres", "Attention Residuals", "AttnRes"),
        Innovation("k3block", "KDA:MLA 3:1 interleave (the K3 block)", "3:1 block"),
        Innovation("longctx", "1M context", "1M context"),
        Innovation("multimodal", "Native multimodal", "Multimodal"),
    )
}

ALIASES: dict[str, str] = {
    "muon": "perheadmuon",
    "per-head-muon": "perheadmuon",
    "mxfp4": "mxfp",
    "mxfp8": "mxfp",
    "mx": "mxfp",
    "mla": "gatedmla",
    "gated-mla": "gatedmla",
    "moe": "latentmoe",
    "latent-moe": "latentmoe",
    "qb": "latentmoe",
    "interleave": "k3block",
    "block": "k3block",
    "kimi-delta-attention": "kda",
    "situ-glu": "situ",
    "attention-residuals": "attnres",
    "1m": "longctx",
    "long-context": "longctx",
    "vision": "multimodal",
}


class UnknownInnovation(ValueError):
    pass


def canonical(name: str) -> str:
    """Resolve an id or alias to its canonical id, case-insensitively."""
    key = name.strip().lower()
    if key in INNOVATIONS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    known = ", ".join(INNOVATIONS)
    raise UnknownInnovation(f"unknown innovation {name!r}; canonical ids are {known}")
