"""This CPU's int32 multiply-add rate, measured: the denominator of the benches' roofline figures.

A dot product of two int32 vectors that stay in L1 cache, summed in int32 (wrapping is fine: only
the speed matters), so gcc vectorises it to packed 32-bit multiplies and adds with -O3
-march=native, the same flags every kernel is compiled with. `reps` repeats over the same data.
"""

import numpy as np


# pythran export int32_mac(int32[:], int32[:], int)
def int32_mac(a, b, reps):
    """sum over reps of sum_i a_i b_i in wrapping int32: reps * len(a) multiply-adds."""
    total = np.int32(0)
    n = a.shape[0]
    for r in range(reps):
        s = np.int32(0)
        for i in range(n):
            s += a[i] * b[i]
        total += s + np.int32(r)
    return total
