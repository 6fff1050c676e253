"""A CPU forward compiled whole by `torch.compile` (Inductor's C++ backend).

An eager CPU decode step of SmolLM2-135M runs about a thousand small operators (norms,
RoPE, residual adds, SiLU x up, splits, casts), each costing microseconds of dispatch;
on a small CPU that was a third of the batch-1 step. Compiled, the operators between two
GEMMs become one C++ loop: the step is the GEMMs (external calls), attention (an opaque
operator, engine/compiled_attention.py) and a few fused kernels.

The compiled function is the Llama family's decoder stack (Llama, SmolLM2, Qwen2/3),
written from the model's own modules and parameters (the same operations as
models/llama.py, in float32 or bfloat16: norms and RoPE in float32, cast back as the
eager layers do; Inductor may round differently in the last bits). Other architectures
and CUDA run the eager model. Inductor caches what it compiles on disk
(`TORCHINDUCTOR_CACHE_DIR`, by default under /tmp), so only a first start pays the
compilation; Dynamo traces again in every process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.engine import cpu_linear_op
from sparsevllm.engine.compiled_attention import attention, step_batch
from sparsevllm.layers.cpu_linear import packing_applies
from sparsevllm.layers.linear import unpack_linears
from sparsevllm.layers.mlp import GatedMLP
from sparsevllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


# "auto" compiles models at least this large: the default model (135M parameters) spends
# a third of an eager batch-1 step in small operators, while a test's tiny model runs its
# steps in milliseconds and would only pay the compilation (tens of seconds cold).
AUTO_MIN_PARAMETERS = 50_000_000


def with_cpu_compile(
    model: nn.Module, choice: str, device: torch.device, dtype: torch.dtype
) -> nn.Module | CompiledForward:
    """The model, or its compiled forward when `choice` ("auto", "on", "off": the
    config's `cpu_compile`) asks for it and it applies."""
    if choice == "off" or device.type != "cpu":
        return model
    applies = compile_applies(model, dtype)
    if choice == "on" and not applies:
        raise ValueError(
            "cpu_compile='on' serves float32 or bfloat16 dense Llama-family models (Llama, "
            f"SmolLM2, Qwen2/3) on the CPU, not {type(model).__name__} in {dtype}"
        )
    if choice == "auto" and not (applies and _parameters(model) >= AUTO_MIN_PARAMETERS):
        return model
    assert isinstance(model, LlamaForCausalLM)
    # The loader packed its linears for eager use; the compiled forward traces plain ones
    # and picks its own kernel per call (engine/cpu_linear_op.py).
    unpack_linears(model)
    return CompiledForward(model)


def compile_applies(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the compiled forward serves this CPU model: a dense Llama-family model in
    float32, or in bfloat16 where oneDNN packs bfloat16 weights (the compiled layers
    call the packed GEMMs through an opaque operator; unpacked bfloat16 `F.linear`
    reorders the weight on every call)."""
    if not isinstance(model, LlamaForCausalLM):
        return False
    if dtype != torch.float32 and not (
        dtype == torch.bfloat16 and packing_applies(torch.device("cpu"), dtype)
    ):
        return False
    if type(model).decoder_layer is not LlamaDecoderLayer:  # MoE families
        return False
    layer = _layers(model)[0]
    return layer.self_attn.qkv.weight is not None and _mlp(layer).gate_up.weight is not None


def _layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]


def _mlp(layer: LlamaDecoderLayer) -> GatedMLP:
    return cast(GatedMLP, layer.mlp)  # a dense Llama layer's (compile_applies)


def _parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class LayerWeights(NamedTuple):
    """One decoder layer's tensors, the arguments of the compiled layer (Dynamo guards on
    their shapes and dtypes, which every layer shares: one graph serves all of them)."""

    layer_index: torch.Tensor  # 0-d int64: the layer's index, for the attention operator
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, Hq * D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, I]
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None


class LayerShape(NamedTuple):
    """What every decoder layer of the model shares (constants of the compiled graph)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_sizes: tuple[int, ...]
    intermediate: int
    eps: float
    scale: float
    act: Callable[[torch.Tensor], torch.Tensor]


class CompiledForward:
    """`model(input_ids, batch)` with each decoder layer through one compiled function;
    embeddings, RoPE angles, the final norm and `compute_logits` stay eager."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.layers = [_weights_of(layer) for layer in _layers(model)]
        self.packed = cpu_linear_op.PackedWeights()  # GEMMs of 4+ rows read packed forms
        for weights in self.layers:
            for matrix in (weights.qkv, weights.o, weights.gate_up, weights.down):
                self.packed.add(matrix)
        self.packed.add(model.lm_head.weight)
        self.shape = _shape_of(_layers(model)[0])
        self._layer = torch.compile(_decoder_layer, dynamic=True, fullgraph=True)
        self._seen: set[bool] = set()  # which shape classes (one token, more) compiled

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        m = self.model.model
        single = input_ids.shape[0] == 1  # Dynamo specialises a size of 1: its own graph
        first, start = single not in self._seen, time.perf_counter()
        x = m.embed_tokens(input_ids)  # [T, hidden]
        rotary = m.rotary_emb
        cos = rotary.get_buffer("cos_cache")[batch.positions].unsqueeze(1)  # [T, 1, D/2]
        sin = rotary.get_buffer("sin_cache")[batch.positions].unsqueeze(1)
        with step_batch(batch), self.packed.active():
            for weights in self.layers:
                x = self._layer(x, cos, sin, weights, self.shape)
        if first:
            self._seen.add(single)
            kind = "1 token" if single else "T tokens"
            logger.info(
                "compiled CPU decoder layer (%s): %.1f s", kind, time.perf_counter() - start
            )
        return cast(torch.Tensor, m.norm(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[S, vocab]` of hidden states `[S, hidden]` (the LM head by rows too)."""
        head = self.model.lm_head
        with self.packed.active():
            return cpu_linear_op.linear(hidden, head.weight, head.bias)

    def __getattr__(self, name: str) -> object:
        # Everything else (rope_frequencies, sliding_window_layers, ...) is the model's.
        return getattr(self.model, name)


def _weights_of(layer: LlamaDecoderLayer) -> LayerWeights:
    a, mlp = layer.self_attn, _mlp(layer)
    assert a.qkv.weight is not None and mlp.gate_up.weight is not None
    return LayerWeights(
        torch.tensor(a.layer_idx),
        layer.input_layernorm.weight,
        a.qkv.weight,
        a.qkv.bias,
        a.o_proj.weight,
        a.o_proj.bias,
        layer.post_attention_layernorm.weight,
        mlp.gate_up.weight,
        mlp.gate_up.bias,
        mlp.down_proj.weight,
        mlp.down_proj.bias,
        a.q_norm.weight if a.qk_norm else None,
        a.k_norm.weight if a.qk_norm else None,
    )


def _shape_of(layer: LlamaDecoderLayer) -> LayerShape:
    a = layer.self_attn
    return LayerShape(
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        tuple(a.qkv.sizes),
        _mlp(layer).down_proj.in_features,
        layer.input_layernorm.eps,
        a.scale,
        _mlp(layer).act,
    )


def _decoder_layer(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights, s: LayerShape
) -> torch.Tensor:
    """LlamaDecoderLayer.forward (models/llama.py) as plain tensor code: x `[T, hidden]`,
    cos/sin `[T, 1, D/2]`; attention through the custom operator."""
    t = x.shape[0]
    h = _rms_norm(x, w.input_norm, s.eps)
    q, k, v = _linear(h, w.qkv, w.qkv_bias).split(s.qkv_sizes, dim=-1)
    q = q.reshape(t, s.num_heads, s.head_dim)
    k = k.reshape(t, s.num_kv_heads, s.head_dim)
    v = v.reshape(t, s.num_kv_heads, s.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        q = _rms_norm(q, w.q_norm, s.eps)
        k = _rms_norm(k, w.k_norm, s.eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    o = attention(q, k, v, w.layer_index, s.scale)  # [T, Hq, D]
    x = x + _linear(o.reshape(t, -1), w.o, w.o_bias)
    h = _rms_norm(x, w.post_norm, s.eps)
    gate, up = _linear(h, w.gate_up, w.gate_up_bias).split(s.intermediate, dim=-1)
    return x + _linear(s.act(gate) * up, w.down, w.down_bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x `[T, in]` -> `[T, out]`. One float32 token: `F.linear` (Inductor calls MKL's
    GEMV, and fuses a residual add into it); otherwise the packed dispatch of
    engine/cpu_linear_op.py (Dynamo specialises T == 1, so each graph holds one of the
    two; bfloat16 reads the packed weight at every row count)."""
    if x.shape[0] == 1 and x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    return cpu_linear_op.linear(x, weight, bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.py's RMSNorm: normalised in float32, cast back, then scaled."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (layers/rotary.py): x `[T, H, D]`, cos/sin `[T, 1, D/2]`."""
    x1, x2 = x.float().chunk(2, dim=-1)  # in float32, as layers/rotary.py
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
