"""Which half of a codec's error costs retrieval: its keys or its values? (diagnostic, CPU)

Runs `rkv eval` with every ResidualKV store patched so that attention reads part of each coded layer's
history exact (the rest as the codec reconstructs it):

    python benchmarks/kv_half_probe.py keys   -- --methods full,residualkv-standalone --context-len 2048 --json OUT
    python benchmarks/kv_half_probe.py values -- --methods full,residualkv-standalone --context-len 2048 --json OUT

    python benchmarks/kv_half_probe.py outliers:0.03 -- --methods full,residualkv-standalone --context-len 2048 --json OUT
    python benchmarks/kv_half_probe.py values@3-7,9-11 -- --methods full,residualkv-standalone --context-len 2048 --json OUT
    python benchmarks/kv_half_probe.py snap -- --methods full,residualkv-snapkv-r03 --context-len 2048 --json OUT

`keys`: pre-RoPE keys exact, values reconstructed; `values`: the reverse. `outliers:P`: both halves of
the share P of coded tokens the references predict worst (largest ‖x - mean of its k references‖², the
threshold fixed at the first write's (1 - P) quantile per layer) exact, every other token reconstructed:
what an exact side channel for badly predicted tokens would buy. `@LAYERS` (ranges and ids, e.g.
`keys@3-7,9`) limits the exact half to those layers: which layers' error costs retrieval. `snap` (with a
`residualkv-snapkv-rNN` method): the tokens SnapKV would keep, chosen per coded layer by the question's
votes after the prompt, are read exact on every later step and nothing is evicted: what a query-chosen
exact side channel would buy. (The newest tokens read exact, once a mode here, are now the cache's own
`recent_window`, counted in KR: the `-wNN` method suffix of `rkv eval`.) The exact part is held beside
the store and is **not counted**: the KR these rows report is the codec's, not what the diagnostic held,
so the rows rank where the codec's error hurts, they are not a method. References keep their FP8 round
trip (the part read exact is the float original). Full reads only (torch path): OmniKV selection and
SnapKV eviction raise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv import stores as stores_mod  # noqa: E402
from residualkv import codec as codec_mod  # noqa: E402
from residualkv.codec import parse_layers  # noqa: E402
from residualkv.cli import main as rkv_main  # noqa: E402
from residualkv.retrieval import mean_of_refs  # noqa: E402
from kernels import topk_l2  # noqa: E402


def _install(keep, overlay, layers: set[int] | None = None) -> None:
    """Patch ResidualStore: keep(store, kv, reconstruction, n_before, refs_before) edits what a write returns
    and holds the exact part beside the store; overlay(store, history) writes it over every read. With
    `layers`, only the stores of those layers are patched (a LayerCodec learns its id at construction)."""
    store = stores_mod.ResidualStore
    write, read = store.write, store.read
    codec_init = codec_mod.ResidualCodec.__init__

    def tagging_init(self, *args, **kwargs):
        codec_init(self, *args, **kwargs)
        for i, layer in self.layers.items():
            layer.probe_layer_id = int(i)

    def probed(self) -> bool:
        return layers is None or getattr(self.codec, "probe_layer_id", None) in layers

    def patched_write(self, kv: torch.Tensor) -> torch.Tensor:
        if not probed(self):
            return write(self, kv)
        n0, r0 = self.n, self.n_refs
        new = write(self, kv).clone()
        keep(self, kv, new, n0, r0)
        return new

    def patched_read(self, rope=None, latent=False):
        if self.ref_ord is not None or self.grad_history is not None:
            raise RuntimeError("kv_half_probe diagnoses standalone reads only")
        out = read(self, None)
        if out.numel() and probed(self):
            overlay(self, out)
        # a latent read (decode steps, residualkv.attention.LatentValues) gets whole values and Z = 0
        z = out.new_zeros(*out.shape[:2], self.codec.dims.d_c) if latent else None
        return stores_mod._with_latent(out, rope, None, z) if rope is not None else out

    def refuse(self, *args, **kwargs):
        raise RuntimeError("kv_half_probe diagnoses standalone reads only (no OmniKV/SnapKV selection)")

    store.write, store.read, store.read_selected = patched_write, patched_read, refuse
    codec_mod.ResidualCodec.__init__ = tagging_init


def _append(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if held is None else torch.cat([held, new], dim=1)


def patch(half: str, layers: set[int] | None = None) -> None:
    def exact_slice(d: int) -> slice:
        return slice(0, d // 2) if half == "keys" else slice(d // 2, d)

    def keep(self, kv, new, n0, r0):
        s = exact_slice(kv.shape[-1])
        new[..., s] = kv[..., s].float()
        self.exact_half = _append(getattr(self, "exact_half", None), kv[..., s].float())

    def overlay(self, out):
        out[..., exact_slice(out.shape[-1])] = self.exact_half

    _install(keep, overlay, layers)


def patch_outliers(share: float) -> None:
    def keep(self, kv, new, n0, r0):
        is_ref = self.schedule.is_ref(n0, n0 + kv.shape[1]).to(kv.device)
        x = kv.float()
        # the references each token may use are those strictly before it, as the codec's own write sees them
        n_avail = torch.cumsum(is_ref.long(), 0) + r0 - is_ref.long()
        refs = self.decoded_refs()
        err = (x - mean_of_refs(refs, topk_l2(x, refs, n_avail, self.cfg.k, impl="torch"))).pow(2).sum(-1)
        err[:, is_ref] = -1.0
        if not hasattr(self, "outlier_threshold"):
            coded = err[err >= 0]
            self.outlier_threshold = torch.quantile(coded, 1 - share) if coded.numel() > 10 else float("inf")
        exact = err > self.outlier_threshold
        new[exact] = x[exact]
        self.exact_mask = _append(getattr(self, "exact_mask", None), exact)
        self.exact_rows = _append(getattr(self, "exact_rows", None), x)

    def overlay(self, out):
        out[self.exact_mask] = self.exact_rows[self.exact_mask]

    _install(keep, overlay)


def patch_snap_exact() -> None:
    """Mode `snap`, with a `residualkv-snapkv-rNN` method: the tokens SnapKV would keep (sinks, the
    observation window and the best-voted others, chosen per coded layer after the prompt) are read exact
    on every later step, and nothing is evicted: every other token stays as coded. One row per cache, as
    `rkv eval` runs (a batch store would be split into rows before the choice, losing the exact copy)."""
    def keep(self, kv, new, n0, r0):
        self.exact_rows = _append(getattr(self, "exact_rows", None), kv.float())

    def overlay(self, out):
        ords = getattr(self, "exact_ords", None)
        if ords is not None:
            out[:, ords] = self.exact_rows[:, ords]

    def promote(self, keep_ords):
        self.exact_ords = torch.unique(keep_ords.to(torch.long))
        return {"evicted_refs": 0, "evicted_codes": 0, "hidden_refs": 0}

    _install(keep, overlay)
    stores_mod.ResidualStore.evict = promote


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    half, _, layer_spec = mode.partition("@")
    if len(sys.argv) < 3 or sys.argv[2] != "--" or not (half in ("keys", "values") or mode == "snap" or mode.startswith("outliers:")):
        raise SystemExit(__doc__)
    if mode.startswith("outliers:"):
        patch_outliers(float(mode.split(":", 1)[1]))
    elif mode == "snap":
        patch_snap_exact()
    else:
        patch(half, set(parse_layers(layer_spec, where=mode)) if layer_spec else None)
    return rkv_main(["eval", *sys.argv[3:]])


if __name__ == "__main__":
    raise SystemExit(main())
