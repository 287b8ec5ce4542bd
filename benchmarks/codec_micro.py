"""Codec micro-benchmarks on the CPU (SPEC §5): encode and reconstruct as achieved bandwidth.

One coded layer's `ResidualStore`, run as the library runs it here (torch path, float32), at a backbone's
codec shape, with the machine's own roofs measured in the same run beside it:
- encode a 1024-token prefill chunk, and one decode-step token, into a store already holding the context
  (the write path: L2 top-k over the references, their mean, f_c on token and mean, INT4 pack);
- reconstruct every token (standalone's read) and an OmniKV-sized selection (`read_selected`);
- the write path's two parts alone: `topk_l2` and the INT4 quantise-and-pack.
Each row gives the median time, the bytes the call must move (what it read: inputs, the stored bytes
it decoded, counted from the store's own instrumentation, and weights; what it wrote: stored bytes and
the float32 reconstruction it returns), GB/s of both against a device-to-device copy measured in
this run, and GFLOP/s of its arithmetic against a float32 GEMM of the encoder's shape timed in this
run. The codec is untrained (random weights, the backbone YAML's dims): speed does not depend on them.

    python benchmarks/codec_micro.py                       # SmolLM2-135M and Llama-3.1-8B shapes, 8K context
    python benchmarks/codec_micro.py --quick               # smoke test: small context, few repeats
    python benchmarks/codec_micro.py --backbones smollm2-135m --context 4096 --threads 2

Writes benchmarks/results/codec_micro_cpu{_quick}.json and a PNG next to it. The GPU kernels' own
micro-benchmarks are in gpu_bench.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import quantize_pack, topk_l2  # noqa: E402
from kernels.quant_pack import bytes_moved as quant_bytes  # noqa: E402
from kernels.topk_l2 import bytes_read as topk_bytes  # noqa: E402
from residualkv.backbones import get_backbone  # noqa: E402
from residualkv.codec import LayerCodec  # noqa: E402
from residualkv.config import CodecDims, load_codec_defaults  # noqa: E402
from residualkv.schedule import ReferenceSchedule  # noqa: E402
from residualkv.stores import ResidualStore  # noqa: E402
from cpu_matmul import cpu_model, gflops  # noqa: E402
from gpu_bench import measured_copy_gbps, time_ms  # noqa: E402

CPU = torch.device("cpu")
BACKBONES = "smollm2-135m,llama-3.1-8b-instruct"
CHUNK = 1024  # prefill chunk the encode rows write, and the fill's write size


def stored_bytes(store: ResidualStore) -> int:
    return sum(store.nbytes().values())


def decoded_bytes(store: ResidualStore, codes: int, refs: int) -> int:
    """Stored bytes behind `codes` latent codes and `refs` reference rows that a read decoded."""
    def row_bytes(t: torch.Tensor) -> int:  # one token's share of a [B, n, ...] tensor
        return t[0, 0].numel() * t.element_size()

    per_code = sum(row_bytes(t) for t in store.codes) + row_bytes(store.ref_idx)
    return codes * per_code + refs * row_bytes(store.refs)


def weight_bytes(*modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def encoder_flops(dims: CodecDims, tokens: int) -> int:
    """f_c on each coded token and on its reference mean (SwiGLU: two d_kv x d_ff products, one d_ff x d_c),
    then W_d to return the reconstruction."""
    f_c = 2 * (2 * dims.d_kv * dims.d_ff) + 2 * dims.d_ff * dims.d_c
    return tokens * (2 * f_c + 2 * dims.d_c * dims.d_kv)


def row(case: str, ms: float, read: int, written: int, flop: int, roofs: dict, **extra) -> dict:
    s = ms * 1e-3
    r = {"case": case, "ms": round(ms, 4), "bytes_read": int(read), "bytes_written": int(written),
         "GBps_read_write": round((read + written) / s / 1e9, 3), "gflop": round(flop / 1e9, 4),
         "GFLOPs": round(flop / s / 1e9, 2)}
    r["pct_copy_bandwidth"] = round(100 * r["GBps_read_write"] / roofs["copy_GBps"], 1)
    r["pct_gemm_rate"] = round(100 * r["GFLOPs"] / roofs["gemm_fp32_GFLOPs"], 1)
    r.update(extra)
    return r


def filled_store(codec: LayerCodec, cfg, n: int, gen: torch.Generator) -> ResidualStore:
    store = ResidualStore(codec, cfg, ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha))
    for s in range(0, n, CHUNK):
        store.write(torch.randn(1, min(CHUNK, n - s), codec.dims.d_kv, generator=gen))
    return store


def encode_row(case: str, base: ResidualStore, T: int, gen, roofs: dict, iters: int) -> dict:
    """Time `write` of T new tokens on copies of `base` (a write appends: each call gets a fresh copy, made
    outside the timing, sharing the codec's weights)."""
    dims = base.codec.dims
    kv = torch.randn(1, T, dims.d_kv, generator=gen)
    memo = {id(base.codec): base.codec, id(base.cfg): base.cfg}
    copies = [copy.deepcopy(base, memo=dict(memo)) for _ in range(iters + 1)]
    before = stored_bytes(base)
    it = iter(copies)
    ms = time_ms(lambda: next(it).write(kv), CPU, iters=iters, warmup=1)
    after = copies[0]
    coded = after.codes.codes.shape[1] - base.codes.codes.shape[1]
    refs_considered = topk_bytes(kv, base.refs, torch.tensor([base.n_refs]))
    read = kv.numel() * 4 + refs_considered + weight_bytes(base.codec)
    written = (stored_bytes(after) - before) + kv.numel() * 4
    flop = encoder_flops(dims, coded) + 2 * coded * base.n_refs * dims.d_kv
    return row(case, ms, read, written, flop, roofs, tokens=T, coded_tokens=coded, history=base.n,
               us_per_token=round(1e3 * ms / T, 2))


def read_row(case: str, store: ResidualStore, ordinals, roofs: dict, iters: int) -> dict:
    """Time a reconstruction (`read` when ordinals is None, else `read_selected`); the bytes it decoded come
    from the store's counters of codes and reference rows decoded, over one call."""
    fn = store.read if ordinals is None else (lambda: store.read_selected(ordinals))
    c0, r0 = store.codes_decoded, store.refs_decoded
    out = fn()
    codes, refs = store.codes_decoded - c0, store.refs_decoded - r0
    ms = time_ms(fn, CPU, iters=iters, warmup=1)
    dims = store.codec.dims
    w_d = store.codec.w_d.weight
    read = decoded_bytes(store, codes, refs) + w_d.numel() * w_d.element_size()
    written = out.numel() * out.element_size()
    return row(case, ms, read, written, 2 * codes * dims.d_c * dims.d_kv, roofs, tokens=out.shape[1],
               codes_decoded=codes, refs_decoded=refs, history=store.n)


def shape_rows(name: str, context: int, select: int, roofs: dict, iters: int, seed: int) -> dict:
    spec = get_backbone(name)
    cfg = load_codec_defaults(spec.codec, list(spec.full_attention_layers))
    d_kv = 2 * spec.architecture["num_kv_heads"] * spec.architecture["head_dim"]
    dims = CodecDims(d_kv, spec.codec["d_c"], spec.codec["d_ff"])
    # the arithmetic roof at this codec's shape: a prefill chunk through its first encoder product
    roofs = dict(roofs, gemm_fp32_GFLOPs=round(gflops(torch.float32, CHUNK, d_kv, dims.d_ff, 1.0), 1),
                 gemm_shape=[CHUNK, d_kv, dims.d_ff])
    gen = torch.Generator().manual_seed(seed)
    codec = LayerCodec(dims).requires_grad_(False)
    t0 = time.perf_counter()
    print(f"{name}: d_kv {d_kv}, d_c {dims.d_c}, d_ff {dims.d_ff}, stride {cfg.stride}, k {cfg.k}; fp32 GEMM "
          f"{roofs['gemm_fp32_GFLOPs']} GFLOP/s at {roofs['gemm_shape']}; filling {context} tokens ...", flush=True)
    rows = []
    with torch.inference_mode():
        base = filled_store(codec, cfg, context - CHUNK, gen)
        rows.append(encode_row(f"encode {CHUNK}-token prefill chunk", base, CHUNK, gen, roofs, iters))
        if bool(base.schedule.is_ref(base.n, base.n + 1).all()):  # a decode step that codes its token
            base.write(torch.randn(1, 1, d_kv, generator=gen))
        rows.append(encode_row("encode 1 decode-step token", base, 1, gen, roofs, 5 * iters))
        full = filled_store(codec, cfg, context, gen)
        rows.append(read_row(f"reconstruct all {context} tokens", full, None, roofs, iters))
        pick = torch.sort(torch.randperm(context, generator=gen)[:select]).values[None]
        rows.append(read_row(f"reconstruct {select} selected of {context}", full, pick, roofs, 3 * iters))
        # the write path's two parts on the prefill chunk alone, with the library's torch reference
        kv = torch.randn(1, CHUNK, d_kv, generator=gen)
        n_avail = torch.full((CHUNK,), full.n_refs)
        ms = time_ms(lambda: topk_l2(kv, full.refs, n_avail, cfg.k, ref_format=cfg.ref_format, impl="torch"),
                     CPU, iters, 1)
        rows.append(row(f"topk_l2 {CHUNK} tokens vs {full.n_refs} refs", ms, topk_bytes(kv, full.refs, n_avail),
                        CHUNK * cfg.k * 8, 2 * CHUNK * full.n_refs * d_kv, roofs, tokens=CHUNK))
        z = torch.randn(CHUNK, dims.d_c, generator=gen)
        rd, wr = quant_bytes(z, cfg.bits, cfg.group_size)
        ms = time_ms(lambda: quantize_pack(z, cfg.bits, cfg.group_size, impl="torch"), CPU, iters, 1)
        rows.append(row(f"quantise+pack {CHUNK} latents, {cfg.bits}-bit g{cfg.group_size}", ms, rd, wr, 0, roofs,
                        tokens=CHUNK))
    for r in rows:
        print(f"  {r['case']:42s} {r['ms']:9.3f} ms {r['GBps_read_write']:8.3f} GB/s "
              f"({r['pct_copy_bandwidth']:5.1f}% copy) {r['GFLOPs']:7.1f} GFLOP/s ({r['pct_gemm_rate']:5.1f}% GEMM)",
              flush=True)
    return {"backbone": name, "gemm_fp32_GFLOPs": roofs["gemm_fp32_GFLOPs"], "gemm_shape": roofs["gemm_shape"], "d_kv": d_kv, "d_c": dims.d_c, "d_ff": dims.d_ff, "stride": cfg.stride, "k": cfg.k,
            "bits": cfg.bits, "group_size": cfg.group_size, "ref_format": cfg.ref_format, "context": context,
            "select": select, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 + 0.45 * len(shapes[0]["rows"]) * len(shapes)))
    for ax, key, label in ((axes[0], "pct_copy_bandwidth", "% of copy bandwidth (bytes read + written)"),
                           (axes[1], "pct_gemm_rate", "% of fp32 GEMM rate (arithmetic)")):
        labels, vals = [], []
        for sh in shapes:
            for r in sh["rows"]:
                labels.append(f"{sh['backbone']}: {r['case']}")
                vals.append(r[key])
        ax.barh(range(len(vals)), vals, color="tab:blue")
        ax.set_yticks(range(len(vals)), labels if ax is axes[0] else [""] * len(vals), fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    gemm = ", ".join(f"{sh['backbone']} {sh['gemm_fp32_GFLOPs']}" for sh in shapes)
    fig.suptitle(f"ResidualKV codec on {report['cpu']}, {report['threads']} thread(s): copy "
                 f"{report['roofs']['copy_GBps']} GB/s; fp32 GEMM at each encoder's shape (GFLOP/s): {gemm}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbones", default=BACKBONES, help=f"comma-separated backbone names (default {BACKBONES})")
    ap.add_argument("--context", type=int, default=8192, help="tokens in the store (default 8192)")
    ap.add_argument("--select", type=int, default=None,
                    help="tokens the selective read reconstructs (default: the backbone's OmniKV budget, 2048)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per row (median; default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2048 tokens, 256 selected, 2 calls")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/codec_micro_cpu.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.context, args.select, args.iters = 2048, args.select or 256, 2
    if args.context <= CHUNK:
        ap.error(f"--context {args.context}: give more than {CHUNK} tokens (the encode rows write a {CHUNK}-token "
                 "chunk after the rest)")
    torch.set_num_threads(args.threads)
    names = [b.strip() for b in args.backbones.split(",") if b.strip()]
    t0 = time.perf_counter()
    roofs = {"copy_GBps": round(measured_copy_gbps(CPU), 2)}
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s): copy {roofs['copy_GBps']} GB/s (read + written)",
          flush=True)
    report = {"schema": "residualkv-codec-micro/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": " ".join(["python", "benchmarks/codec_micro.py"] + (argv if argv is not None else sys.argv[1:])),
              "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "roofs": roofs, "shapes": []}
    for i, name in enumerate(names):
        select = args.select or load_codec_defaults(get_backbone(name).codec, []).select_budget
        report["shapes"].append(shape_rows(name, args.context, min(select, args.context), roofs, args.iters, seed=i))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = args.out or ROOT / "benchmarks" / "results" / f"codec_micro_cpu{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
