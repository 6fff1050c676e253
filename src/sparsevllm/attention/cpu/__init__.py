"""Native CPU kernels: C sources compiled once per machine by the system's C compiler
(native.py) and called through ctypes (decode.py)."""
