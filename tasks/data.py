"""Pack the training corpus into fixed-length blocks (residualkv.training.packing)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from residualkv.training import pack_documents, resolve_source

from .common import say, shared_backbone


def packed_data(backbone_ref: str, data: dict[str, Any]):
    """The PackedData for these settings (packed once; later calls reuse the packed folder)."""
    _, tokenizer, _ = shared_backbone(backbone_ref)
    source = resolve_source(data.get("source", "offline"), text_field=data.get("text_field", "text"))
    return pack_documents(source, tokenizer, int(data["seq_len"]))


@task(name="pack-data", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def pack_data(backbone_ref: str, data: dict[str, Any]) -> dict[str, Any]:
    packed = packed_data(backbone_ref, data)
    meta = packed.meta
    say(f"packed {meta['train_blocks']} training / {meta['heldout_blocks']} held-out blocks of "
          f"{meta['seq_len']} tokens from {meta['source']} ({packed.path})")
    return {"path": str(packed.path), "fingerprint": meta["fingerprint"], "source": meta["source"],
            "seq_len": meta["seq_len"], "train_blocks": meta["train_blocks"], "heldout_blocks": meta["heldout_blocks"]}
