"""DeltaKV (Hao et al., 2026): KV compression by residuals against full-precision centers.

This package is the definition, importable without the engine (a serving method may use
it): `spec` (a compressor's dims and reference rule), `centers` (which tokens stay full
precision and which centers a compressed token refers to), `compressor` (the per-layer
down/up maps, compress and reconstruct), `latent_codes` (optional INT4 latents), `rope`
(pool keys <-> the pre-RoPE keys it compresses) and `checkpoint` (safetensors files bound
to one model). The tool chain that collects K/V, trains and evaluates compressors is
`sparsevllm.deltakv_tools`; docs/methods.md ("DeltaKV") states the definition.
"""
