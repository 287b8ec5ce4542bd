"""Perplexity of held-out text decoded through a (compressed) cache.

The first `n_context` tokens are prefilled into a fresh cache in one call (compressed on write); the
next `n_tokens` are then fed one at a time, each step with the cache, so every scored token is predicted
from compressed history and is itself written compressed before the next step. The first scored token
is predicted by the prefill's last position.
"""

from __future__ import annotations

import math
import time

import torch

from ..config import InputError


def heldout_ids(tokenizer, n_total: int, offset: int = 0) -> torch.Tensor:
    """[1, n_total] token ids of the held-out offline corpus (`data.offline_text(heldout=True)`)."""
    from ..data import offline_text

    text = offline_text((n_total + offset) * 6, heldout=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] < n_total + offset:
        text = offline_text((n_total + offset) * 12, heldout=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] < n_total + offset:
        raise InputError(f"the held-out corpus has only {ids.shape[1]} tokens; lower --ppl-context/--ppl-tokens")
    return ids[:, offset : offset + n_total]


@torch.no_grad()
def cache_perplexity(model, cache, ids: torch.Tensor, n_context: int) -> dict:
    """NLL/perplexity of ids[:, n_context:] given ids[:, :n_context], token by token through `cache`."""
    if ids.shape[0] != 1:
        raise ValueError("cache_perplexity scores one sequence at a time")
    n_total = ids.shape[1]
    if not 0 < n_context < n_total:
        raise ValueError(f"need 0 < n_context ({n_context}) < total tokens ({n_total})")
    device = next(model.parameters()).device
    ids = ids.to(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, :n_context], cache=cache, use_cache=True, logits_to_keep=1)
    t_prefill = time.perf_counter() - t0
    nll = -torch.log_softmax(out.logits[0, -1].float(), -1)[ids[0, n_context]].item()
    for t in range(n_context, n_total - 1):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True,
                    position_ids=torch.tensor([[t]], device=device))
        nll -= torch.log_softmax(out.logits[0, -1].float(), -1)[ids[0, t + 1]].item()
    n = n_total - n_context
    mean = nll / n
    return {"nll": mean, "ppl": math.exp(mean), "tokens": n, "prefill_s": t_prefill,
            "decode_s": time.perf_counter() - t0 - t_prefill}
