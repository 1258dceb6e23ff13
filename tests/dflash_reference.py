"""z-lab's published DFlash model (PyPI `dflash`, `dflash.model`) as the drafter parity reference.

Run with the HF-reference Python (the Makefile's .venv-hf):
    python tests/dflash_reference.py JOB.json
JOB.json: {"cases": [CASE, ...]}; each CASE names "drafter" (an HF DFlash directory) and "out",
and is one of:
- {"inputs": F.npz}: F holds `features` [1, C, n_taps * H], `embed` [V, H], `lm_head` [V, H],
  `blocks` [R, T] and `context_ends` [R] (increasing). Round r feeds context
  features[:, prev_end:end] and block r at positions end .. end + T - 1, keeping the drafter's
  cache between rounds and cropping it after each block, as `dflash_generate` does. Writes
  `logits_r` [T - 1, V] (block slots 1 .. T - 1) per round.
- {"target": D, "prompt": [ids]}: HF's DeepseekV3ForCausalLM from D runs the prompt with
  `output_hidden_states`; the drafter gets `extract_context_feature` of its hidden states and
  the block [greedy next token, mask ...]. Writes `root` and `logits` [T - 1, V].
Everything runs in float32 on the CPU.
"""

import json
import sys

import numpy as np
import torch
from dflash.model import DFlashDraftModel, _crop_to, _make_cache, extract_context_feature
from transformers import DeepseekV3ForCausalLM


def _draft(model, features, embeddings, positions, cache, head):
    hidden = model(
        position_ids=positions,
        noise_embedding=embeddings,
        target_hidden=features,
        past_key_values=cache,
        use_cache=True,
    )
    return model.compute_logits(hidden[:, 1:], head)[0]


def _rounds(model, inputs) -> dict[str, np.ndarray]:
    head = torch.nn.Linear(inputs["lm_head"].shape[1], inputs["lm_head"].shape[0], bias=False)
    head.weight.data = torch.from_numpy(inputs["lm_head"])
    embed = torch.from_numpy(inputs["embed"])
    features = torch.from_numpy(inputs["features"])
    # The cache `dflash_generate` keeps (sliding layers hold their window), cropped as it crops.
    cache, start, out = _make_cache(model.config), 0, {}
    for r, (block, end) in enumerate(zip(inputs["blocks"], inputs["context_ends"], strict=True)):
        t = len(block)
        positions = torch.arange(start, end + t)[None]
        logits = _draft(model, features[:, start:end], embed[torch.from_numpy(block)][None], positions, cache, head)
        out[f"logits_{r}"] = logits.numpy()
        _crop_to(cache, int(end))
        start = int(end)
    return out


def _end_to_end(model, target_dir: str, prompt: list[int]) -> dict[str, np.ndarray]:
    target = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager")
    target.eval()
    ids = torch.tensor([prompt])
    out = target(ids, output_hidden_states=True)
    root = int(out.logits[0, -1].argmax())
    block = torch.full((1, model.block_size), model.mask_token_id).index_fill_(1, torch.tensor([0]), root)
    features = extract_context_feature(out.hidden_states, model.target_layer_ids)
    positions = torch.arange(len(prompt) + model.block_size)[None]
    logits = _draft(model, features, target.get_input_embeddings()(block), positions, None, target.lm_head)
    return {"root": np.array(root), "logits": logits.numpy()}


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    for case in job["cases"]:
        model = DFlashDraftModel.from_pretrained(case["drafter"], dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            if "target" in case:
                out = _end_to_end(model, case["target"], case["prompt"])
            else:
                out = _rounds(model, dict(np.load(case["inputs"])))
        np.savez(case["out"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
