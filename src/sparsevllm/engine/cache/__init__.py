"""Cross-request KV state: one `PrefixStore` protocol (`store.py`), two stores (the radix
prefix cache and the chain cache) and one tier stack (host memory, then disk) under both.

Pure-Python modules (the scheduler may import them): `store.py` and `tiering.py` (the
protocols), `radix_tree.py`, `radix_tiering.py`, `radix_store.py`, `chains.py`,
`chain_tiering.py`, `chain_store.py`. The modules that move KV bytes (`kv_rows.py`,
`host_tier.py`, `disk_tier.py`, `tier_stack.py`, `chain_state.py`) and the wiring
(`build.py`) import torch.
"""
