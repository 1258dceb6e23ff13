"""compressed-tensors, the reference for the INT4 pack-quantized format (runs in the HF environment).

    python tests/ct_reference.py IN.safetensors DENSE.npz OUT.npz

For every `*.weight_packed` in IN (written by ddtree_jax), decompresses the module with
compressed-tensors' `PackedQuantizationCompressor` -> "<name>.weight" (float32), and
compresses DENSE.npz's "<name>.weight" (float32, [out, in]) with the module's stored scale
-> "<name>.weight_packed" (int32), both into OUT.npz.
"""

import sys

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file


def main(src: str, dense_path: str, out_path: str) -> None:
    stored = load_file(src)
    dense = np.load(dense_path)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    )
    out = {}
    for name in sorted(k for k in stored if k.endswith(".weight_packed")):
        base = name.removesuffix(".weight_packed")
        module = {k.removeprefix(base + "."): v for k, v in stored.items() if k.startswith(base + ".")}
        weight = PackedQuantizationCompressor.decompress(module, scheme)["weight"]
        out[base + ".weight"] = weight.to(torch.float32).numpy()
        w = torch.from_numpy(dense[base + ".weight"]).to(module["weight_scale"].dtype)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": module["weight_scale"]}, scheme)
        out[base + ".weight_packed"] = packed["weight_packed"].numpy()
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
