"""Which tokens are stored as references (seed §2.6).

Tokens are counted by their ordinal within their own sequence (0 = first real token), so a left-padded
row gets exactly the schedule it would get alone. Ordinals 0..n_sink-1 are sink references; after them
references sit at p_0 = n_sink and p_{m+1} = p_m + s0 + floor(alpha * (p_m - n_sink)). alpha = 0 is the
fixed stride. The schedule is extended lazily, so it works token by token while decoding.
"""

from __future__ import annotations

import math
from bisect import bisect_left

import torch


class ReferenceSchedule:
    def __init__(self, n_sink: int, stride: int, alpha: float = 0.0):
        self.n_sink = int(n_sink)
        self.stride = int(stride)
        self.alpha = float(alpha)
        self._positions: list[int] = []  # ref ordinals, increasing, as far as asked for
        # the same ordinals as a tensor, grown with the list: every layer asks at every decode step, and
        # rebuilding it from the list each time cost more than the step's reference bookkeeping itself.
        # Both start empty, so a cache that never asks holds none of it (see bookkeeping_bytes).
        self._tensor = torch.empty(0, dtype=torch.long)
        self._next = 0  # next reference ordinal
        # per device: the layout over the first `covered` ordinals (see `layout`), computed ahead
        self._layouts: dict[torch.device, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # (selection, its key, plan) of the last selection a decode step read (ResidualStore._plan): the layers
        # reading one selection share it; the cache drops it when the step ends
        self.selection_plan: tuple | None = None

    def _extend(self, n: int) -> None:
        new = []
        while self._next < n:
            new.append(self._next)
            self._next += 1 if self._next < self.n_sink else self.stride + math.floor(self.alpha * (self._next - self.n_sink))
        if new:
            self._positions.extend(new)
            self._tensor = torch.cat([self._tensor, torch.tensor(new, dtype=torch.long)])

    def ref_ordinals(self, n: int) -> torch.Tensor:
        """Ordinals of the references among the first n tokens."""
        self._extend(n)
        return self._tensor[: bisect_left(self._positions, n)].clone()

    def is_ref(self, start: int, end: int) -> torch.Tensor:
        """Boolean mask over ordinals [start, end)."""
        mask = torch.zeros(max(end - start, 0), dtype=torch.bool)
        self._extend(end)
        lo, hi = bisect_left(self._positions, start), bisect_left(self._positions, end)
        mask[self._tensor[lo:hi] - start] = True
        return mask

    def layout(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(is_ref [n] bool, reference ordinals [R] long, code ordinals [n - R] long) over ordinals
        [0, n), as views of tensors kept on `device`. Every compressed layer reads this at every decode
        step: kept on the device and computed ahead (an eighth more, plus 256 ordinals), a step costs
        no host work over the history and no host-to-device copy, and reads index with it instead of
        boolean masks (each of which is a host-device sync on a GPU)."""
        device = torch.device(device)
        kept = self._layouts.get(device)
        if kept is None or kept[0] < n:
            covered = max(n, (kept[0] if kept else 0) * 9 // 8 + 256)
            is_ref = self.is_ref(0, covered)
            self._layouts[device] = kept = (covered, is_ref.to(device), self.ref_ordinals(covered).to(device),
                                            torch.arange(covered)[~is_ref].to(device))
        n_refs = bisect_left(self._positions, n)
        return kept[1][:n], kept[2][:n_refs], kept[3][: n - n_refs]

    def split(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions of the references, positions of the codes) among ordinals [start, end), counted
        from `start`, on `device` (a write's chunk, indexed without a boolean mask)."""
        _, refs, codes = self.layout(end, device)
        r0 = bisect_left(self._positions, start)
        return refs[r0:] - start, codes[start - r0 :] - start

    def nbytes(self) -> int:
        """The ordinals held as tensors: bookkeeping the config determines, not stored data."""
        return sum(t.numel() * t.element_size() for t in (self._tensor, *(t for kept in self._layouts.values()
                                                                            for t in kept[1:])))

    def count_in(self, start: int, end: int) -> int:
        """How many references among ordinals [start, end), without building a mask."""
        self._extend(end)
        return max(bisect_left(self._positions, end) - bisect_left(self._positions, start), 0)

    def count(self, n: int) -> int:
        return int(self.ref_ordinals(n).numel())

    def formula_count(self, n: int) -> float:
        """The seed's closed form for the non-sink references among n tokens (plus the sinks)."""
        t = max(n - self.n_sink, 0)
        sinks = min(n, self.n_sink)
        if self.alpha == 0.0:
            return sinks + t / self.stride
        return sinks + math.log1p(self.alpha * t / self.stride) / math.log1p(self.alpha)
