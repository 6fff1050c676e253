"""Kernel-test setup: two fixes for the Triton 3.6 interpreter (CPU runs only).

1. The interpreter holds scalars as 1-element 1-D arrays and converts them with
   `int(array)`, which NumPy >= 2.4 rejects; every loop whose bounds come from a loaded
   value (`for j in range(start, end, BLOCK)`) then fails. We convert through the
   single element instead.
2. Its `tl.dot` multiplies bfloat16 operands as their raw uint16 bit patterns (bf16 is
   stored as uint16 there), giving garbage. We widen bf16 operands to float32 first,
   which is what a tensor core does (exact products, fp32 accumulation).

Neither touches compiled kernels: on a GPU this module does nothing.
"""

from __future__ import annotations

import os


def _patch_interpreter() -> None:
    try:
        import numpy as np
        import triton.language as tl
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

    interpreter._patch_lang_tensor = patched_tensor
    builder.create_dot = patched_dot
    interpreter._sparsevllm_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()
