"""1M context: RoPE phases and YaRN scaling as integer kernels, proven at 2^20 tokens."""
