"""Runs HF transformers' DeepseekV3ForCausalLM as the parity reference.

Run with a Python that has torch + transformers (the Makefile's .venv-hf):
    python tests/hf_reference.py JOB.json
JOB.json: {"cases": [{"dir": D, "prompts": [[ids...], ...], "max_new_tokens": N, "out": F.npz}]}.
For each case it writes F.npz with, per prompt i, `logits_i` [len, V] from one full
eager float32 forward and `greedy_i` [N] from `generate(do_sample=False)`. A case with
"k25_dir": D2 also saves the model, as transformers' own Kimi_K25ForConditionalGeneration
(a small vision tower beside it), to D2 with `save_pretrained`.
"""

import json
import sys

import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM
from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

# The smallest vision tower Kimi_K25Config builds: only there so the saved files are K2.5's.
VISION = {
    "patch_size": 2,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "pos_emb_time": 2,
}


def save_as_kimi_k25(model: DeepseekV3ForCausalLM, path: str) -> None:
    """The text model's weights inside transformers' K2.5 wrapper, saved as transformers saves it."""
    cfg = Kimi_K25Config(
        text_config=model.config.to_dict(),
        vision_config=VISION,
        projection_hidden_size=16,
        tie_word_embeddings=model.config.tie_word_embeddings,
    )
    wrapper = Kimi_K25ForConditionalGeneration(cfg)
    wrapper.model.language_model.load_state_dict(model.model.state_dict())
    wrapper.lm_head.load_state_dict(model.lm_head.state_dict())
    wrapper.save_pretrained(path)


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
        if "k25_dir" in case:
            save_as_kimi_k25(model, case["k25_dir"])


if __name__ == "__main__":
    main(sys.argv[1])
