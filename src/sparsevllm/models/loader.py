"""Model loading: HF directories (safetensors), GGUF files and dummy weights.

`load_model_source` resolves what to load (config, tokenizer, EOS ids) without
building the model; `build_model` creates the module on the device and fills it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sparsevllm.layers.cpu_linear import packing_applies
from sparsevllm.layers.linear import fuse_projections, pack_linears
from sparsevllm.layers.parallel import SINGLE, ModelSharder, Slicer, TensorParallel
from sparsevllm.models.registry import model_class_for


@dataclass
class ModelSource:
    path: str
    load_format: str  # hf | gguf | dummy
    hf_config: Any
    tokenizer: Any | None
    eos_token_ids: set[int] = field(default_factory=set)
    # GGUF weights being dequantized on a worker thread while the config and the
    # tokenizer are built (see `_prefetch_gguf_weights`).
    weights: Future[dict[str, torch.Tensor]] | None = None


def detect_format(path: str, load_format: str) -> str:
    if load_format != "auto":
        return load_format
    if path.endswith(".gguf"):
        return "gguf"
    return "hf"


def load_model_source(model: str | None, tokenizer: str | None, load_format: str) -> ModelSource:
    """Resolve the model path (bundled default if None), its HF config and tokenizer."""
    if model is None:
        from sparsevllm.models.default_model import default_model_path

        model = default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model {model!r} not found: give a model directory, a .gguf file or a config.json"
        )
    fmt = detect_format(model, load_format)
    weights = None
    if fmt == "gguf":
        from sparsevllm.models.gguf_loader import load_gguf_config

        hf_config = load_gguf_config(model)  # parses the file; the weights reuse the parse
        weights = _prefetch_gguf_weights(model)
    else:
        hf_config = _hf_config(model)
    # Fails early on unsupported architectures. A model class may narrow the config to
    # the part it runs (multimodal Gemma 3 -> its text config) before the engine sizes
    # the KV pool from it.
    adapt = getattr(model_class_for(hf_config), "adapt_config", None)
    if adapt is not None:
        hf_config = adapt(hf_config)
    tok = _load_tokenizer(tokenizer or model)
    return ModelSource(model, fmt, hf_config, tok, _eos_ids(model, hf_config, tok), weights)


def _hf_config(model: str) -> Any:
    """The HF config of a model directory (its config.json) or of a JSON file of any name."""
    from transformers import AutoConfig

    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"model directory {model!r} has no config.json")
        return AutoConfig.from_pretrained(model)
    if not model.endswith(".json"):
        raise ValueError(
            f"model {model!r} is neither a directory, a .gguf file nor a .json config "
            "(set load_format to say how to read it)"
        )
    try:
        with open(model) as f:
            values = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {model!r} is not valid JSON: {e}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(
            f"{model!r} is not a Hugging Face model config (it has no model_type); engine "
            "settings go to --config (LLM.from_config), not --model"
        )
    return AutoConfig.from_pretrained(model)


def _prefetch_gguf_weights(path: str) -> Future[dict[str, torch.Tensor]]:
    """Dequantize a GGUF file's weights on a worker thread. numpy drops the GIL in its
    array passes, so on a 2-core machine they overlap importing transformers' config
    classes and building the tokenizer (about a second each for the default model)."""
    from sparsevllm.models.gguf_loader import load_gguf_state_dict

    future: Future[dict[str, torch.Tensor]] = Future()

    def run() -> None:
        try:
            future.set_result(load_gguf_state_dict(path))
        except BaseException as e:  # handed to whoever waits for the weights
            future.set_exception(e)

    threading.Thread(target=run, name="sparsevllm-gguf-weights", daemon=True).start()
    return future


def _load_tokenizer(path: str) -> Any | None:
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        from sparsevllm.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    tok_dir = os.path.dirname(path) if path.endswith(".json") else path
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(tok_dir, n)) for n in names):
        return None  # dummy configs without a tokenizer: token-id prompts only
    return AutoTokenizer.from_pretrained(tok_dir)


def _eos_ids(path: str, hf_config: Any, tokenizer: Any | None) -> set[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    gen_path = os.path.join(path if os.path.isdir(path) else "", "generation_config.json")
    if os.path.isdir(path) and os.path.exists(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# torch.nn.init functions that nn.Linear and nn.Embedding draw their initial weights with.
_INIT_FUNCTIONS = ("kaiming_uniform_", "uniform_", "normal_")


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Build modules without drawing initial weights: every parameter is overwritten by
    the checkpoint (or by `_init_dummy`), and the draws took a second for 135M weights."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_model(
    source: ModelSource,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """Create the model on `device` in `dtype` and load (or randomly draw) its weights;
    under tensor parallelism, this rank's part of it (`layers/parallel.py`; the model's
    `head_shard` then names the attention heads it holds)."""
    cls = model_class_for(source.hf_config)
    slicers: dict[str, Slicer] = {}
    if tp.active:
        model, slicers = _build_shard(cls, source, max_position, dtype, device, tp)
    else:
        with _default_dtype(dtype), torch.device(device), _no_weight_init():
            model = cls(source.hf_config, max_position)
    # Fused before loading: the projections' parameters become views into the fused
    # tensors, so each weight is written once, in place, instead of loaded then copied.
    fuse_projections(model)
    if device.type == "cuda":
        # The unfused weights' freed blocks would otherwise stay reserved by the caching
        # allocator and shrink the KV pool sized from the free memory.
        torch.cuda.empty_cache()
    if source.load_format == "dummy":
        _init_dummy(model, seed)
    else:
        state = _state_dict(source)
        remap = getattr(model, "remap_checkpoint", None)  # e.g. multimodal Gemma 3 names
        load_weights(model, remap(state) if remap is not None else state, slicers)
    if packing_applies(device, dtype):
        pack_linears(model)
    return model.eval()


def _build_shard(
    cls: type[nn.Module],
    source: ModelSource,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
) -> tuple[nn.Module, dict[str, Slicer]]:
    """This rank's part of the model, never the whole: built on the meta device (shapes,
    no memory), cut by `ModelSharder`, then allocated on `device`, where modules with
    computed buffers (RoPE tables) compute them again (`rebuild_buffers`). Every weight
    is left to the loader; a model larger than one device fits its ranks."""
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(source.hf_config, max_position)
    sharder = ModelSharder(tp)
    sharder.shard(model)
    model.head_shard = sharder.heads
    # Allocating gives every module a parameter of its own: tied ones (an LM head that
    # is the embedding) are tied again after it.
    tied = _tied_groups(model)
    model.to_empty(device=device)
    for group in tied:
        shared = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    with _default_dtype(dtype), torch.device(device):
        for module in model.modules():
            rebuild = getattr(module, "rebuild_buffers", None)
            if rebuild is not None:
                rebuild()
    left = [
        f"{name}.{attr}" if name else attr
        for name, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.is_meta
    ]
    if left:
        raise RuntimeError(
            f"{cls.__name__} keeps tensors computed at construction that tensor-parallel "
            f"construction cannot allocate ({', '.join(left[:5])}): give their module a "
            "rebuild_buffers method"
        )
    return model, sharder.slicers


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor, per tensor with more than one name."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _state_dict(source: ModelSource) -> dict[str, torch.Tensor]:
    if source.weights is not None:
        return source.weights.result()
    if source.load_format == "gguf":
        from sparsevllm.models.gguf_loader import load_gguf_state_dict

        return load_gguf_state_dict(source.path)
    return load_safetensors_dir(source.path)


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path!r} (or use load_format=dummy)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state


def load_weights(
    model: nn.Module, state: dict[str, torch.Tensor], slicers: dict[str, Slicer] | None = None
) -> None:
    """Copy HF-named tensors into the model, failing on missing or unexpected names;
    `slicers` cut a tensor to this tensor-parallel rank's part first."""
    slicers = slicers or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    unexpected = [k for k in state if k not in params and "rotary_emb" not in k]
    if unexpected:
        raise ValueError(f"checkpoint has tensors the model does not know: {unexpected[:5]}")
    loaded = set()
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                if name in slicers:
                    tensor = slicers[name](tensor)
                if params[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                        f"model shape {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor)
                loaded.add(name)
    missing = [k for k in params if k not in loaded and not (tied and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {missing[:5]}")


def _init_dummy(model: nn.Module, seed: int) -> None:
    # Small normal weights keep activations finite through many layers, so dummy
    # benchmarks exercise the same numerics as real ones.
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
