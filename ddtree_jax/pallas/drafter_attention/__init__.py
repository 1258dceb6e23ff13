"""The DFlash drafter's block attention: a block of queries over the drafter's context cache
(windowed) and its own keys; reference (also the XLA path), Triton-lowered kernel, dispatch."""
