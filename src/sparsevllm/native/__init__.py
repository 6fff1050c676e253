"""Native CPU kernels: C sources compiled once per machine by the system's C compiler
and loaded through ctypes (build.py). Their callers keep torch paths for machines
without a compiler: the CPU attention backend's decode (attention/cpu/decode.py) and the
CPU RMSNorm (layers/cpu_norm.py)."""
