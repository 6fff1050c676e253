"""A random DeltaKV compressor of a model's real dimensions, for throughput runs.

Speed depends on the shapes only (latent widths, centers, references), not on what the
maps learned, so the H200 decode benchmark of a dummy-weight model (`bench throughput
--model-config llama3-8b`) serves with a random linear compressor of the dims a trained
one would have: every managed layer, latent width kv_dim / 4 (the project's default),
center stride 10, 4 references. Its metadata names the model's config fingerprint, so
the engine accepts it for that model and refuses it for others.

    python scripts/deltakv_random_compressor.py --model-config llama3-8b --out c.safetensors
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig

from sparsevllm.bench.model_configs import MODEL_CONFIGS, write_model_config
from sparsevllm.calibration.identity import model_identity
from sparsevllm.deltakv.checkpoint import save_compressor
from sparsevllm.deltakv.compressor import DeltaKVCompressor
from sparsevllm.deltakv.spec import DeltaKVSpec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), help="A bench model config.")
    src.add_argument("--model", help="A Hugging Face model directory.")
    p.add_argument("--out", required=True, help="Checkpoint path to write (.safetensors).")
    p.add_argument("--latent-dim", type=int, help="Latent width per layer (default kv_dim / 4).")
    p.add_argument("--stride", type=int, default=10, help="Center stride (default 10).")
    p.add_argument("--references", type=int, default=4, help="References (default 4).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the random maps (default 0).")
    args = p.parse_args()
    model_dir = write_model_config(args.model_config) if args.model_config else args.model
    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_dim = 2 * cfg.num_key_value_heads * head_dim
    layers = tuple(range(cfg.num_hidden_layers))
    spec = DeltaKVSpec(
        layers=layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        latent_dims=(args.latent_dim or kv_dim // 4,) * len(layers),
        center_stride=args.stride,
        num_references=args.references,
    )
    torch.manual_seed(args.seed)
    compressor = DeltaKVCompressor(spec)
    with torch.no_grad():  # reconstructions near the references' mean, like a trained map
        for layer in layers:
            compressor.codec(layer).up_proj.weight.mul_(0.5)
    save_compressor(args.out, compressor, model_identity(model_dir, cfg.to_dict()))
    print(f"{args.out}: {len(layers)} layers, kv_dim {kv_dim}, latent {spec.latent_dims[0]}")


if __name__ == "__main__":
    main()
