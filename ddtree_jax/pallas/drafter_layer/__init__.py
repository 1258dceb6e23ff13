"""The DFlash drafter layer's QKV projection, its norms and RoPE as one kernel (reference.py,
kernel.py, api.py, bench.py)."""
