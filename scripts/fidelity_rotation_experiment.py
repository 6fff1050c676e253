"""Experiment: int8 / fp8 KV with an orthonormal Hadamard rotation of every K and V row
before per-token absmax quantization (dot products are preserved; outlier channels are
spread over the row), measured with `bench fidelity`. The rotation is patched into the
reference quantizer (kv/scaled.py) for this process only, so it runs on the CPU (torch
reference backend); it is not a format of the engine. Usage:

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/fidelity_rotation_experiment.py \
        bench fidelity --formats int8,fp8_e4m3 --json out/rotated.json
"""
import sys
import torch
import sparsevllm.kv.scaled as sc

_q, _dq = sc.quantize, sc.dequantize
_H = {}


def hadamard(d: int) -> torch.Tensor:
    if d not in _H:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        assert h.shape[0] == d
        _H[d] = (h / d**0.5).float()
    return _H[d]


def quantize(x, element):
    return _q(x.float() @ hadamard(x.shape[-1]), element)


def dequantize(data, scale, dtype):
    return (_dq(data, scale, torch.float32) @ hadamard(data.shape[-1]).T).to(dtype)


sc.quantize, sc.dequantize = quantize, dequantize
from sparsevllm.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
