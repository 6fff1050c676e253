"""The CPU attention backend's native decode kernel (sparsevllm/native/decode_attention.c),
called through ctypes (decode.py)."""
