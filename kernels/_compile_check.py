"""Compile every kernel to a CUDA binary without a GPU: `python -m kernels._compile_check [--arch 90,80]`.

Triton's interpreter runs Python semantics, so it accepts code the real compiler rejects (and the
other way round). This lowers each kernel, with the exact arguments its dispatcher passes, through
TTIR -> TTGIR -> LLVM -> PTX -> cubin using the ptxas bundled with triton. Run it in a process where
TRITON_INTERPRET is unset: in interpreter mode triton.language's own helpers are not compilable.
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

import torch


def capture_launches(full: bool = True) -> list[tuple[str, object, tuple, dict]]:
    """Call every dispatcher on small CPU tensors with the kernel launch intercepted.

    full=False keeps one variant per kernel - the deployment one (bf16 model, 2-bit packing, the
    most involved) - for a faster check."""
    from residualkv.stores import KiviStore
    from residualkv.codec import LayerCodec
    from residualkv.config import CodecDims, ResidualKVConfig
    from residualkv.quant import encode_ref, index_bits, pack_indices, quantize

    import importlib

    # by module path: the package re-exports a function under the name `topk_l2`
    ka, qp, rc, tk = (importlib.import_module(f"{__package__}.{m}")
                      for m in ("kivi_attention", "quant_pack", "reconstruct", "topk_l2"))

    launches = []

    class Capture:
        def __init__(self, kernel, label):
            self.kernel, self.label = kernel, label

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.label, self.kernel.fn, args, kw))

    patches = [mock.patch.object(m, "use_triton", lambda *a, **k: True) for m in (qp, tk, rc, ka)]
    patches += [mock.patch.object(qp, "_kernel", Capture(qp._kernel, "quant_pack")),
                mock.patch.object(tk, "_kernel", Capture(tk._kernel, "topk_l2")),
                mock.patch.object(rc, "_kernel", Capture(rc._kernel, "reconstruct")),
                mock.patch.object(ka, "_attn", Capture(ka._attn, "kivi_attention")),
                mock.patch.object(ka, "_merge", Capture(ka._merge, "kivi_merge"))]
    for p in patches:
        p.start()
    try:
        torch.manual_seed(0)
        for bits in (2, 4) if full else (2,):
            qp.quantize_pack(torch.randn(4, 512), bits, 32)
        refs = encode_ref(torch.randn(1, 40, 256), "fp8")
        tk.topk_l2(torch.randn(1, 5, 256), refs, torch.full((5,), 40), 4, ref_format="fp8")
        H, D, d_c = 2, 128, 512
        codes = quantize(torch.randn(1, 8, d_c), 4, 32)
        refs = encode_ref(torch.randn(1, 5, 2 * H * D), "fp8")
        ridx = pack_indices(torch.randint(0, 5, (1, 8, 4)), index_bits(5))
        cos = torch.randn(1, 3, D)
        dtypes = (torch.float32, torch.bfloat16) if full else (torch.bfloat16,)
        sel = torch.tensor([[0, 1, 2]])
        for dtype in dtypes:
            codec = LayerCodec(CodecDims(2 * H * D, d_c, 16)).to(dtype)
            if full:  # cos/sin tensors
                rc.reconstruct_selected(codes, ridx, refs, codec, sel, cos, cos, bits=4, group=32, num_kv_heads=H,
                                        out_dtype=dtype)
            # angles from positions (what the benchmark's decode path uses)
            rc.reconstruct_selected(codes, ridx, refs, codec, sel, positions=sel, inv_freq=torch.ones(D // 2),
                                    bits=4, group=32, num_kv_heads=H, out_dtype=dtype)
        st = KiviStore(ResidualKVConfig(full_bits=4))
        st.write(torch.randn(1, 2, 100, D), torch.randn(1, 2, 100, D))
        for dtype in dtypes:
            ka.kivi_decode_attention(torch.randn(1, 8, 1, D).to(dtype), st)
    finally:
        for p in reversed(patches):
            p.stop()
    return launches


LAUNCH_OPTIONS = ("num_warps", "num_stages")  # launch keywords that are compiler options, not kernel arguments


def compile_all(arch: int = 90, full: bool = True) -> list[tuple[str, bool, str]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type

    if triton.knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: interpreter-mode triton.language cannot be compiled")
    results = []
    for label, fn, args, kw in capture_launches(full):
        jf = JITFunction(fn)
        options = {k: kw.pop(k) for k in LAUNCH_OPTIONS if k in kw}
        sig = {name: mangle_type(a) for name, a in zip(jf.arg_names, args)}
        sig.update({name: "constexpr" for name in kw})
        try:
            compiled = triton.compile(ASTSource(jf, sig, kw), target=GPUTarget("cuda", arch, 32), options=options)
            results.append((label, "cubin" in compiled.asm, f"{len(compiled.asm['cubin'])} B cubin"))
        except Exception as e:  # report every kernel, not just the first failure
            results.append((label, False, f"{type(e).__name__}: {e}"))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90",
                    help="CUDA compute capabilities x10, comma-separated (90 = H100/H200, 80 = A100)")
    ap.add_argument("--quick", action="store_true", help="one variant per kernel (bf16, 2-bit)")
    args = ap.parse_args(argv)
    failed = False
    for arch in (int(a) for a in args.arch.split(",")):
        results = compile_all(arch, full=not args.quick)
        for label, ok, info in results:
            print(f"{'ok  ' if ok else 'FAIL'} {label:16s} sm_{arch}: {info}")
        failed |= not results or not all(ok for _, ok, _ in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
