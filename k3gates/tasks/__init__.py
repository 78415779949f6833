"""What the attention tasks of issue 15 share: a tiny sequence model on K3-μ's kernels."""
