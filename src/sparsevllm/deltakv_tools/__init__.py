"""The DeltaKV tool chain: `sparsevllm deltakv collect | train | eval`.

`collect` (with `capture`, `sources`, `shards`) runs the engine and saves K, V and queries;
`capture_set` and `dataset` read them back as training views; `train` (with `losses`,
`pca_init`, `train_state`, `plot`) fits a compressor; `evaluate` measures one. The
definition they fit lives in `sparsevllm.deltakv`; docs/methods.md ("DeltaKV") states it.
"""
