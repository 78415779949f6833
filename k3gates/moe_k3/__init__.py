"""One LatentMoE layer at Kimi K3's published MoE shape, expert-parallel on Dask (issue 19, item 4).

K3's MoE layer (K3-SPEC.md section 4): 896 routed experts, 16 chosen per token, 2 shared experts,
hidden width 7168, latent width 3584, expert width 3072, routed-expert weights in MXFP4
(section 6; 896 x 3 x 3072 x 3584 weights at 4.25 bits = 15.7 GB). Every value is an integer:

    layer.py       the shapes (K3 and a reduced one), deterministic weights from (seed, expert id),
                   the single-process forward and the expert-parallel forward on a Dask client,
                   the formats, worst-case magnitudes and the declared error bounds
    reference.py   an independent float64 forward on a sample of tokens (and so of experts),
                   from the equations, on the dequantised weights; the bound check
    __main__.py    `python -m k3gates.moe_k3 --scale k3|small ...`: runs the layer, checks it,
                   prints per-worker memory, all-to-all bytes, tokens/s and the CPU model

No new kernel: the arithmetic is done by the project's compiled kernels (moe.router,
moe.latent_rmsnorm, mxqat.packed_matmul, situ.situ_glu_array, gemm.gemm_i64, fx's arrays).
"""
