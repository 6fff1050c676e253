"""Write the bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1) as a Hugging Face
folder: config, tokenizer and safetensors of the dequantized weights in bfloat16 (the
default) or float32, the same values our engine computes with in that dtype. Other
engines (vLLM's CPU build) load it.

    python scripts/export_default_model.py OUT_DIR [--dtype float32]
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from sparsevllm.models.default_model import default_model_path
from sparsevllm.models.gguf_loader import load_gguf_state_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="Folder to write (created if missing).")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the written weights (the GGUF's Q4_1 values dequantized to it)",
    )
    args = parser.parse_args()
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    path = default_model_path()
    folder, name = os.path.split(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = args.dtype
    config.save_pretrained(out)
    dtype = getattr(torch, args.dtype)
    state = {k: v.to(dtype).contiguous() for k, v in load_gguf_state_dict(path).items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    print(f"{len(state)} tensors -> {out}")


if __name__ == "__main__":
    main()
