import json, time, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = "cuda"
res = []
def run(name, fn):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    try:
        fn(); torch.cuda.synchronize()
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); dt = time.perf_counter() - t
        res.append(dict(case=name, ok=True, ms=dt * 1e3, peak_extra_mb=(torch.cuda.max_memory_allocated() - base) / 2**20))
    except Exception as e:
        res.append(dict(case=name, ok=False, err=str(e)[:200]))
for H, n, L in [(20, 4096, 4096), (20, 2048, 8192), (128, 2048, 2048), (128, 1024, 8192)]:
    q = torch.randn(1, H, n, 576, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, L, 576, device=dev, dtype=torch.bfloat16)
    k, v = kv, kv[..., :512]
    causal = n == L
    mask = None if causal else (torch.arange(L, device=dev)[None] <= torch.arange(n, device=dev)[:, None] + (L - n))
    ke, ve = k.expand(1, H, L, 576), v.expand(1, H, L, 512)
    kr, vr = k.repeat_interleave(H, 1), v.repeat_interleave(H, 1)
    for tag, kk, vv, gqa in [("gqa", k, v, True), ("expand0", ke, ve, False), ("repeat", kr, vr, False)]:
        for kname, kern in [("default", None), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]:
            def fn():
                if kern is None:
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
                with sdpa_kernel([kern]):
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
            run(f"H{H} n{n} L{L} {tag} {kname}", fn)
    del kr, vr
print(json.dumps(res, indent=0))
