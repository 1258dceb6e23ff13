"""What one decode round launches: the ops of `generate`'s while-loop body, after XLA.

    python experiments/loop_ops.py --method ddtree --budget 32 --out loop_ops.json

Runs one `generate` call with XLA's HLO dump on, then reads the optimized module:
- ops of the loop body by kind (fusion, copy, custom-call, ...) and by named scope
  (draft / verify / ...); on a small target each is roughly one kernel launch;
- "weight/cache slices": fusions that only slice a stacked array (XLA names them
  `wrapped_slice` on the GPU, `slice_bitcast_fusion` on the CPU); on the GPU each is a
  device copy per round;
- on the GPU, the runtime's thunks of the body (`kCustomKernel`, `kCopy`, ...), which
  are what actually launches.
Uses the shipped checkpoints (--checkpoints to override).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import sys
import tempfile

SLICE_NAMES = ("wrapped_slice", "slice_bitcast_fusion")


def body_ops(hlo_text: str) -> dict:
    """Counts of the decode loop body's instructions in an optimized HLO module."""
    lines = hlo_text.split("\n")
    loop = next(line for line in lines if " while(" in line and "decode_loop" in line)
    body = re.search(r"body=%([\w.\-]+)", loop).group(1)
    start = next(i for i, line in enumerate(lines) if line.startswith(f"%{body} "))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
    kinds, scopes = collections.Counter(), collections.Counter()
    slices = 0
    for line in lines[start + 1 : end]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z\-]*)\(", line)
        if not m or m.group(2) in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
            continue
        kinds[m.group(2)] += 1
        slices += m.group(1).startswith(SLICE_NAMES)
        name = re.search(r'op_name="([^"]*)"', line)
        scope = name.group(1).split("while/body/")[-1].split("/")[0] if name else "(unnamed)"
        scopes[scope] += 1
    return {"by_kind": dict(kinds.most_common()), "by_scope": dict(scopes.most_common()), "slices": slices}


def body_thunks(thunk_text: str) -> dict:
    """Counts of thunk kinds inside the while loop's body (GPU thunk sequence dump)."""
    body = thunk_text.split("kWhile", 1)[1].split("body:", 1)[1]
    return dict(collections.Counter(re.findall(r"^\s+\d+: (k\w+)", body, flags=re.M)).most_common())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--method", choices=["ar", "dflash", "ddtree"], default="ddtree")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64, help="random prompt tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--numerics", default=None, help="exact or fast (default: generate's for the dtype)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep-dump", default=None, help="copy the optimized HLO (and GPU thunk sequence) here")
    args = ap.parse_args()

    dump = tempfile.mkdtemp(prefix="loop_ops_")
    # Must be set before jax initialises its backend.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE"
    )
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.generate import generate
    from ddtree_jax.shipped import load_shipped

    shipped = load_shipped(args.checkpoints, dtype=jnp.dtype(args.dtype))
    prompts = np.random.default_rng(0).integers(4, shipped.target.config.vocab_size, size=(args.batch, args.context))
    res = generate(
        shipped.target,
        None if args.method == "ar" else shipped.drafter,
        prompts.astype(np.int32),
        method=args.method,
        tree_budget=args.budget if args.method == "ddtree" else None,
        max_new_tokens=4,
        stop_token_ids=(),
        numerics=args.numerics,
    )
    jax.block_until_ready(res.tokens)
    hlo = sorted(glob.glob(os.path.join(dump, "*jit__generate*after_optimizations.txt")), key=os.path.getmtime)
    if not hlo:
        sys.exit(f"error: no optimized HLO of _generate under {dump}")
    with open(hlo[-1]) as f:
        summary = {"device": jax.devices()[0].device_kind, "args": vars(args), **body_ops(f.read())}
    module = os.path.basename(hlo[-1]).split(".jit__generate")[0]
    thunks = glob.glob(os.path.join(dump, f"{module}.jit__generate.thunk_sequence_after_thunk_passes.txt"))
    if thunks:  # GPU only
        with open(thunks[0]) as f:
            summary["thunks"] = body_thunks(f.read())
    if args.keep_dump:
        os.makedirs(args.keep_dump, exist_ok=True)
        for path in [hlo[-1], *thunks]:
            shutil.copy(path, args.keep_dump)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
