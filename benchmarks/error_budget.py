"""Where a codec's reconstruction error comes from, per layer, keys and values apart (SmolLM2-135M, CPU).

For held-out blocks of the training corpus, each compressed layer's true pre-RoPE keys and values go
through the cache's own write path (schedule, FP8 references, top-k retrieval); every coded token's
relative error energy ||x_hat - x||^2 / ||x||^2 is split into

  residual     ||mean_ref - x||^2       what the references alone leave (the codec's input)
  subspace     the codec unquantised     what d_c latent dimensions and the encoder lose
  int4         the codec as stored       plus the b-bit rounding of the latent

and reference tokens' ||fp8(x) - x||^2 / ||x||^2. Keys and values are reported apart because retrieval
cares about them differently (benchmarks/kv_half_probe.py measures how much). Two more figures say how the
stored residual d_hat = x_hat - mean_ref sits against the true one d = x - mean_ref:

  energy_ratio ||d_hat||^2 / ||d||^2        below 1: the token-specific part comes back shrunk
  ls_scale     <d_hat, d> / ||d_hat||^2      the scale of d_hat that would minimise the squared error
                                             (about 1 for an MSE fit; below 1: d_hat is inflated past it)

Writes JSON and a plot.

    python benchmarks/error_budget.py DIR/codec [DIR2/codec ...] [--blocks 2] [--out benchmarks/results/error_budget.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.codec import ResidualCodec  # noqa: E402
from residualkv.quant import dequantize, quantize, ref_roundtrip  # noqa: E402
from residualkv.schedule import ReferenceSchedule  # noqa: E402
from residualkv.training.packing import pack_documents, resolve_source  # noqa: E402
from residualkv.training.warmstart import capture_kv, residual_pairs  # noqa: E402


def rel(err: torch.Tensor, x: torch.Tensor) -> float:
    return float(err.pow(2).sum() / x.pow(2).sum())


@torch.no_grad()
def budget(codec: ResidualCodec, kv: dict[int, torch.Tensor]) -> list[dict]:
    cfg = codec.config
    n_tokens = next(iter(kv.values())).shape[1]  # every layer holds the same blocks: one schedule for all
    is_ref = ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha).is_ref(0, n_tokens)
    rows = []
    for i in codec.layer_ids:
        x, m = residual_pairs(kv[i], cfg)
        layer = codec.layer(i)
        z = layer.encode(x, m).float()
        unq = layer.decode(z).float() + m
        q = layer.decode(dequantize(quantize(z, cfg.bits, cfg.group_size), cfg.bits, cfg.group_size)).float() + m
        refs = kv[i][:, is_ref].reshape(-1, kv[i].shape[-1])
        d = x.shape[-1] // 2
        for half, s in (("keys", slice(0, d)), ("values", slice(d, None))):
            true_res, stored_res = x[:, s] - m[:, s], q[:, s] - m[:, s]
            rows.append({"layer": i, "half": half,
                         "residual": rel(m[:, s] - x[:, s], x[:, s]),
                         "subspace": rel(unq[:, s] - x[:, s], x[:, s]),
                         "int4": rel(q[:, s] - x[:, s], x[:, s]),
                         "ref_fp8": rel(ref_roundtrip(refs[:, s], cfg.ref_format) - refs[:, s], refs[:, s]),
                         "energy_ratio": rel(stored_res, true_res),
                         "ls_scale": float((stored_res * true_res).sum() / stored_res.pow(2).sum())})
    return rows


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, half in zip(axes, ("keys", "values")):
        for n, (source, rows) in enumerate(results.items()):
            name = Path(source).parent.name if Path(source).name == "codec" else Path(source).name
            r = [x for x in rows if x["half"] == half]
            layers = [x["layer"] for x in r]
            ax.plot(layers, [x["int4"] for x in r], marker="o", color=f"C{n}", label=f"{name}: stored (INT4)")
            ax.plot(layers, [x["subspace"] for x in r], ls="--", color=f"C{n}", label=f"{name}: unquantised")
        r = next(iter(results.values()))
        ax.plot([x["layer"] for x in r if x["half"] == half], [x["residual"] for x in r if x["half"] == half],
                color="grey", ls=":", label="references alone")
        ax.set_yscale("log")
        ax.set_title(f"{half}: relative error energy of coded tokens")
        ax.set_xlabel("layer")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("codecs", nargs="+")
    ap.add_argument("--blocks", type=int, default=2, help="held-out blocks of --seq-len tokens")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/error_budget.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, spec = load_backbone("smollm2-135m")
    packed = pack_documents(resolve_source(None), tok, args.seq_len)
    blocks = torch.tensor(packed.heldout[: args.blocks]["input_ids"])
    results = {}
    for path in args.codecs:
        codec = ResidualCodec.load(path, model.config)
        rows = budget(codec, capture_kv(model, blocks, codec.layer_ids))
        results[path] = rows
        for half in ("keys", "values"):
            r = [x for x in rows if x["half"] == half]
            means = {k: sum(x[k] for x in r) / len(r)
                     for k in ("residual", "subspace", "int4", "ref_fp8", "energy_ratio", "ls_scale")}
            print(f"{path} {half}: " + ", ".join(f"{k} {v:.4f}" for k, v in means.items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backbone": spec.name, "blocks": args.blocks, "seq_len": args.seq_len,
                               "machine": platform.platform(), "torch": torch.__version__,
                               "codecs": results}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
