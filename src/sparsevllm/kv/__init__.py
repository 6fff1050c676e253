"""KV storage formats: how a layer's KV is laid out in the pool's slots.

Every format keeps its buffers slot-major (`[num_slots, num_kv_heads, ...]`), so the
pool's operations (per-head compaction, radix sharing, host and disk tiers) move one
token's bytes by moving one row of every buffer, whatever the format. See format.py
(the interface), registry.py (the formats) and names.py (their names, torch-free, for
the config).
"""
