"""Write the bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1) as a Hugging Face
folder: config, tokenizer and bfloat16 safetensors of the dequantized weights, the same
values our engine computes with in bfloat16. Other engines (vLLM's CPU build) load it.

    python scripts/export_default_model.py OUT_DIR
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
    out = parser.parse_args().out_dir
    os.makedirs(out, exist_ok=True)
    path = default_model_path()
    folder, name = os.path.split(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in load_gguf_state_dict(path).items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    print(f"{len(state)} tensors -> {out}")


if __name__ == "__main__":
    main()
