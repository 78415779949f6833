"""Gates for the K3 block: the 3:1 KDA:MLA layer schedule and the attention memory it implies
(PARTIAL). The composed block (3 KDA + 1 Gated MLA with AttnRes and the MoE FFN) is HAVE's next
step and has no gate yet."""

from __future__ import annotations

import numpy as np

from k3gates.gate import GateContext, gate

from . import reference as ref

# K3's attention state per layer, counted from arrays in the kernels' int32 storage: the KDA state
# H x d_k x d_v = 96 x 128 x 128; the MLA cache row c_KV (512) + shared k_R (64) per token
KDA_STATE = np.zeros((96, 128, 128), dtype=np.int32)
MLA_ROW = np.zeros(512 + 64, dtype=np.int32)
CONTEXTS = [1 << e for e in range(0, 21, 2)]  # 1 .. 2^20 tokens


@gate(
    "k3block_schedule",
    innovation="k3block",
    level="PARTIAL",
    kernels=["k3gates.k3block.kernels"],
    bounds={"memory_exact": 0},
)
def k3block_schedule(ctx: GateContext) -> None:
    """K3's 93 layers are 69 KDA and 24 Gated MLA, MLA at 4, 8, ..., 92 and 93: 3:1 with a final
    global layer; the attention memory of that stack, from arrays, at contexts up to 2^20."""
    k = ctx.compiled()
    kinds = k.layer_schedule(ref.K3_LAYERS, 4)
    mla = [i + 1 for i in range(kinds.size) if kinds[i] == 1]
    ctx.check(
        "k3_schedule",
        "the kernel's 93-layer schedule puts Gated MLA exactly at the 1-based layers K3-SPEC "
        "lists (4, 8, ..., 92, 93), and KDA everywhere else: 69 KDA and 24 MLA",
        mla == ref.K3_MLA_LAYERS and int(kinds.size - kinds.sum()) == 69 and len(mla) == 24,
        kda_layers=int(kinds.size - kinds.sum()),
        mla_layers=len(mla),
    )
    groups = kinds[:92].reshape(23, 4)
    ctx.check(
        "three_to_one",
        "every group of four layers (1-4, 5-8, ..., 89-92) is three KDA layers then one MLA "
        "layer, and the 93rd is a final MLA layer",
        bool((groups == np.array([0, 0, 0, 1], dtype=np.int8)).all()) and kinds[92] == 1,
    )
    gaps = [min(m - (i + 1) for m in mla if m >= i + 1) for i in range(kinds.size)]
    ctx.check(
        "global_within_three",
        "every KDA layer's output reaches a global (MLA) layer within at most 3 layers, and the "
        "stack ends in global attention: not linear attention alone",
        max(gaps) <= 3 and kinds[-1] == 1,
        max_layers_to_global=max(gaps),
    )
    other = [(n, p) for n in range(1, 130) for p in (2, 3, 4, 5, 8) if p <= n]
    wrong = [
        (n, p)
        for n, p in other
        if [i + 1 for i, x in enumerate(k.layer_schedule(n, p)) if x == 1] != ref.mla_layers(n, p)
    ]
    ctx.check(
        "rule_general",
        "the kernel's rule agrees with the spec's rule written out independently for every depth "
        "1..129 and periods 2, 3, 4, 5, 8",
        not wrong,
        cases=len(other),
        first_wrong=str(wrong[:1]),
    )
    _memory(ctx, k, kinds, mla)
    ctx.check_compiled_matches_interpreted("compiled", "layer_schedule", 93, 4)
    ctx.check_deterministic(
        "deterministic",
        "two runs of the schedule give the same bits",
        {"first": k.layer_schedule(93, 4), "second": k.layer_schedule(93, 4)},
    )
    ctx.evidence(
        f"93 layers: {int(kinds.size - kinds.sum())} KDA + {len(mla)} MLA at 4, 8, ..., 92, 93; "
        "the attention memory of the stack measured from arrays up to 2^20 tokens"
    )


def _memory(ctx: GateContext, k, kinds: np.ndarray, mla: list[int]) -> None:
    """The stack's attention memory: 69 fixed KDA states plus 24 growing MLA caches, against the
    same 93 layers all MLA (the 'no KDA' alternative)."""
    state, row = int(KDA_STATE.nbytes), int(MLA_ROW.nbytes)
    all_mla = np.ones(ref.K3_LAYERS, dtype=np.int8)
    got = [k.attention_bytes(kinds, state, row, t) for t in CONTEXTS]
    want = [ref.attention_bytes(ref.K3_LAYERS, mla, state, row, t) for t in CONTEXTS]
    ctx.check_reference(
        "memory_exact",
        "the kernel's count of the stack's attention bytes equals the spec's formula, "
        "69 x KDA state + 24 x MLA row x T, exactly, at every context from 1 to 2^20 tokens",
        np.array(got, dtype=np.float64),
        np.array(want, dtype=np.float64),
        unit="bytes",
    )
    every = [k.attention_bytes(all_mla, state, row, t) for t in CONTEXTS]
    ctx.artifact(
        "table:attention memory of 93 layers (int32 storage, K3 dimensions)",
        {
            "columns": ["tokens", "K3: 69 KDA + 24 MLA (MiB)", "93 MLA layers (MiB)", "ratio"],
            "rows": [
                [t, g / 2**20, e / 2**20, e / g]
                for t, g, e in zip(CONTEXTS, got, every, strict=True)
            ],
        },
    )
    ctx.check(
        "kda_saves_memory",
        "at 2^20 tokens the 3:1 stack holds less attention memory than 93 MLA layers would: the "
        "KDA layers' fixed states cost less than the caches they replace",
        got[-1] < every[-1],
        k3_mib=got[-1] / 2**20,
        all_mla_mib=every[-1] / 2**20,
    )
