"""Kernel-test setup: four fixes for the Triton 3.6 interpreter (CPU runs only).

1. The interpreter holds scalars as 1-element 1-D arrays and converts them with
   `int(array)`, which NumPy >= 2.4 rejects; every loop whose bounds come from a loaded
   value (`for j in range(start, end, BLOCK)`) then fails. We convert through the
   single element instead.
2. Its `tl.dot` multiplies bfloat16 operands as their raw uint16 bit patterns (bf16 is
   stored as uint16 there), giving garbage. We widen bf16 operands to float32 first,
   which is what a tensor core does (exact products, fp32 accumulation).
3. It casts integers to bfloat16 as `astype(uint16)` (the integer becomes the bit
   pattern). We go through float32, as a GPU does.
4. Its float -> float8e4nv downcast rounds ties away from zero, drops the carry of a
   rounded-up mantissa into the exponent (7.9 becomes 4.0) and mishandles subnormals.
   We convert with torch's float8_e4m3fn cast (round to nearest even), saturated at
   +-448 like the GPU's `cvt.rn.satfinite`.

Neither touches compiled kernels: on a GPU this module does nothing.
"""

from __future__ import annotations

import os


def _patch_interpreter() -> None:
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests skip themselves
        return
    if getattr(interpreter, "_sparsevllm_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        patch_tensor(tensor, scope)
        # Registered after the original so the scope's LIFO restore undoes both.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(h):  # type: ignore[no-untyped-def]
        if h.dtype.scalar != tl.bfloat16:
            return h
        data = (h.data.astype(np.uint32) << 16).view(np.float32)  # bf16 = fp32's high half
        return interpreter.TensorHandle(data, tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    cast_impl = builder.cast_impl

    def patched_cast(self, src, dst_type):  # type: ignore[no-untyped-def]
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar.is_int():
            src = interpreter.TensorHandle(src.data.astype(np.float32), tl.float32)
        return cast_impl(self, src, dst_type)

    fp_to_fp = builder.create_fp_to_fp

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        wide = src.dtype.scalar.primitive_bitwidth > 8  # from fp16, bf16, fp32
        if dst_type.scalar != tl.float8e4nv or rounding_mode != ir.ROUNDING_MODE.RTNE or not wide:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        x = widen(src).data.astype(np.float32)
        x = np.clip(x, -448.0, 448.0)  # NaN stays NaN
        fp8 = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(fp8.view(torch.uint8).numpy(), tl.float8e4nv)

    interpreter._patch_lang_tensor = patched_tensor
    builder.create_dot = patched_dot
    builder.cast_impl = patched_cast
    builder.create_fp_to_fp = patched_fp_to_fp
    interpreter._sparsevllm_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()
