"""The drafter's per-depth log-softmax and top-k for DDTree's tree, as one kernel (reference.py,
kernel.py, api.py, bench.py)."""
