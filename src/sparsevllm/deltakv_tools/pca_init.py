"""Closed-form start for linear compressors: weighted PCA of the residuals.

With linear maps, x_hat = b + U D (x - b) + u (the biases fold into u), so the error is
(U D - I) r + u for the residual r = x - b: the best rank-r choice under the training's
relative K and V errors is the PCA of the residuals scaled by w = 1 / mean(k^2) on key
channels and 1 / mean(v^2) on value channels. With E the top eigenvectors of the
scaled residuals' covariance: D = E^T diag(sqrt w), U = diag(1 / sqrt w) E, and u puts
the residuals' mean back. Training then only has to move from there towards what the
attention term adds, which is what makes CPU training of every layer fit in minutes.
MLP maps start from torch's default initialisation instead.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsevllm.deltakv.compressor import DeltaKVCompressor, reference_mean
from sparsevllm.deltakv_tools.dataset import SequenceViews


def _residuals(views: SequenceViews, layer: int, max_tokens: int) -> torch.Tensor:
    """Residuals x - b of the compressed tokens of every sequence, up to `max_tokens`:
    `[n, C]` float64."""
    parts, n = [], 0
    for i in range(len(views)):
        v = views.view(i, layer)
        r = v.x[v.compressed] - reference_mean(v.x[v.refs])  # [N, C]
        parts.append(r[: max_tokens - n].double())
        n += parts[-1].shape[0]
        if n >= max_tokens:
            break
    return torch.cat(parts)


def _channel_weights(views: SequenceViews, layer: int, half: int) -> torch.Tensor:
    """`[C]` float64: 1 / mean square of the keys on key channels, of values on values."""
    sq_k = sq_v = 0.0
    count = 0
    for i in range(len(views)):
        x = views.view(i, layer).x.double()
        sq_k += float((x[:, :half] ** 2).sum())
        sq_v += float((x[:, half:] ** 2).sum())
        count += x.shape[0] * half
    wk, wv = count / max(sq_k, 1e-30), count / max(sq_v, 1e-30)
    return torch.cat([torch.full((half,), wk), torch.full((half,), wv)]).double()


@torch.no_grad()
def pca_init(compressor: DeltaKVCompressor, views: SequenceViews, max_tokens: int = 65536) -> None:
    """Set every layer's linear maps from the residuals of `views` (training data)."""
    spec = compressor.spec
    if spec.hidden_dim:
        raise ValueError("PCA initialisation needs linear maps (hidden_dim 0)")
    half = spec.kv_dim // 2
    for layer in spec.layers:
        r = _residuals(views, layer, max_tokens)  # [n, C]
        sqrt_w = _channel_weights(views, layer, half).sqrt().to(r.device)  # [C]
        mean = r.mean(dim=0)  # [C]
        scaled = (r - mean) * sqrt_w  # [n, C]
        cov = scaled.T @ scaled / max(r.shape[0] - 1, 1)  # [C, C]
        _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
        e = vecs[:, -spec.latent_dim(layer) :]  # [C, r]
        down_w = e.T * sqrt_w[None, :]  # [r, C]
        up_w = e / sqrt_w[:, None]  # [C, r]
        up_b = mean - up_w @ (down_w @ mean)  # [C]
        codec = compressor.codec(layer)
        assert isinstance(codec.down_proj, nn.Linear) and isinstance(codec.up_proj, nn.Linear)
        dtype = codec.down_proj.weight.dtype
        codec.down_proj.weight.copy_(down_w.to(dtype))
        codec.down_proj.bias.zero_()
        codec.up_proj.weight.copy_(up_w.to(dtype))
        codec.up_proj.bias.copy_(up_b.to(dtype))
