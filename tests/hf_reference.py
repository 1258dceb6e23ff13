"""Runs HF transformers' DeepseekV3ForCausalLM as the parity reference.

Run with a Python that has torch + transformers (the Makefile's .venv-hf):
    python tests/hf_reference.py JOB.json
JOB.json: {"cases": [{"dir": D, "prompts": [[ids...], ...], "max_new_tokens": N, "out": F.npz}]}.
For each case it writes F.npz with, per prompt i, `logits_i` [len, V] from one full
eager float32 forward and `greedy_i` [N] from `generate(do_sample=False)`.
"""

import json
import sys

import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM


def main(job_path: str) -> None:
    torch.manual_seed(0)
    with open(job_path) as f:
        job = json.load(f)
    for case in job["cases"]:
        model = DeepseekV3ForCausalLM.from_pretrained(case["dir"], dtype=torch.float32, attn_implementation="eager")
        model.eval()
        out = {}
        with torch.no_grad():
            for i, prompt in enumerate(case["prompts"]):
                ids = torch.tensor([prompt], dtype=torch.long)
                out[f"logits_{i}"] = model(ids).logits[0].numpy()
                n = case["max_new_tokens"]
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )
                out[f"greedy_{i}"] = gen[0, len(prompt) :].numpy()
        np.savez(case["out"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
