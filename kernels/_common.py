"""What every kernel module shares: the optional triton import, the torch/Triton choice, lazy jit.

Dispatch rule (no environment switches in library code): `impl="auto"` runs the Triton kernel when
the tensors live on a CUDA device and triton is installed, and the torch reference otherwise;
`impl="torch"` always runs the reference; `impl="triton"` always runs the kernel, which on CPU
tensors needs Triton's interpreter (TRITON_INTERPRET=1) - that is how the tests exercise the kernels
on a machine without a GPU.
"""

from __future__ import annotations

import torch

try:  # triton ships for Linux only; without it every dispatcher falls back to its torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

IMPLS = ("auto", "triton", "torch")


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return bool(triton.knobs.runtime.interpret)


def interpreter_usable() -> bool:
    """The interpreter also needs triton.language's own jit functions (tl.sum, tl.max, ...) to have
    been decorated in interpreter mode, i.e. TRITON_INTERPRET=1 set before triton.language was first
    imported - which `import transformers` already does."""
    if not interpret_mode():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


def use_triton(impl: str, *tensors: torch.Tensor | None) -> bool:
    """Decide, for one call, whether the Triton kernel runs (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {IMPLS}")
    if impl == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if impl == "auto":
        return triton is not None and on_cuda
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package (Linux); use impl='auto' or 'torch'")
    if not on_cuda and not interpreter_usable():
        raise RuntimeError("impl='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before anything imports triton (transformers does), or pass CUDA tensors")
    return True


class LazyKernel:
    """`triton.jit` applied at the first launch instead of at import.

    Triton decides between compiling and interpreting when a function is *decorated*, by reading
    TRITON_INTERPRET. Decorating lazily lets a test module set that variable even when the library
    imported these modules earlier in the same process. The price: kernels cannot call other jit
    helpers (those would be decorated at import), so each kernel body is self-contained.
    """

    def __init__(self, fn):
        self.fn = fn
        self._built: dict[bool, object] = {}

    @property
    def jitted(self):
        mode = interpret_mode()
        if mode not in self._built:
            self._built[mode] = triton.jit(self.fn)
        return self._built[mode]

    def __getitem__(self, grid):
        return self.jitted[grid]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
