"""Routing replay's record (a mixture-of-experts model, `models/moe.py`): the experts each MoE layer chose for each
token the generator fed, kept per sequence on the host.

Every forward records: a prefill its chunk's tokens, a decode step each sequence's input token; a sequence prefilled
again (preempted from a paged cache, or resuming an episode) records again from where its cache starts. Each output
then carries `routes` [prompt + response tokens, layers, k] (uint8 up to 256 experts): the trainer replays them, so it
routes every token as the generator did. The last token is never fed (it was sampled last), so its routes are k
placeholder experts; its hidden state only makes the logits after the sequence, which no loss reads. A pipelined
generator (pp > 1) does not record (refused by `Generator`).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.models.moe import recorded_routes, route_dtype


class RouteLog:
    """One sequence's recorded routes [n, layers, k] on the host, in one buffer that doubles as it grows: a decode
    step appends one position, and a long response's thousands of positions stay one tensor (not one small tensor
    each, which hundreds of sequences would make millions of Python objects)."""

    __slots__ = ("_buf", "_n")

    def __init__(self):
        self._buf: Optional[torch.Tensor] = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, rows: torch.Tensor) -> None:
        """Add the routes of the next positions, [m, layers, k] (copied: `rows` may be a reused buffer)."""
        m = rows.shape[0]
        if self._buf is None or self._n + m > self._buf.shape[0]:
            grown = torch.empty((max(2 * (self._n + m), 16), *rows.shape[1:]), dtype=rows.dtype)
            if self._n:
                grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n: self._n + m] = rows
        self._n += m

    def truncate(self, n: int) -> None:
        """Keep the first n positions (those a sequence's cache still holds)."""
        self._n = min(self._n, n)

    def recorded(self) -> Optional[torch.Tensor]:
        """The positions recorded so far, [n, layers, k] (a view; None before the first)."""
        return None if self._buf is None else self._buf[: self._n]


class RouteRecorder:
    """The routes a generator records (module docstring): taken from the model after each forward, kept per
    sequence on the host, in the compact dtype."""

    def __init__(self, model: torch.nn.Module, on: bool):
        self.model, self.on = model, on
        self.dtype = route_dtype(model.config.num_moe_experts) if on else None
        self._host: list = [None, None]

    def take(self) -> Optional[torch.Tensor]:
        """The last forward's routes [s, b, layers, k] on the device (None when not recording)."""
        if not self.on:
            return None
        return recorded_routes(self.model).to(self.dtype)

    def prefilled(self, admitted: list, routes: torch.Tensor) -> None:
        """A prefill's routes [width, rows, layers, k] to the sequences it fed (`Prefill.of`'s rows), after the
        positions each one's cache still held (a preempted sequence's are recorded again)."""
        rows = [q for q in admitted if q.length - 1 > q.cached]
        host = routes.transpose(0, 1).cpu()
        for j, q in enumerate(rows):
            q.routes.truncate(q.cached)
            q.routes.append(host[j, : q.length - 1 - q.cached])

    def to_host(self, routes: Optional[torch.Tensor], parity: int, pin: bool) -> Optional[torch.Tensor]:
        """A decode step's routes [slots, layers, k] copied (without waiting) into one of two host buffers."""
        if routes is None:
            return None
        buf = self._host[parity]
        if buf is None or buf.shape != routes.shape:
            buf = self._host[parity] = torch.empty(routes.shape, dtype=routes.dtype, pin_memory=pin)
        return buf.copy_(routes, non_blocking=True)

    def output(self, log: RouteLog, length: int) -> Optional[torch.Tensor]:
        """[length, layers, k] of a sequence of `length` positions (its routes `log`): the recorded positions, then
        placeholders (experts 0..k-1) for the last."""
        if not self.on:
            return None
        log.truncate(length - 1)
        layers, k = self.model.config.num_layers, self.model.config.moe_router_topk
        have = log.recorded()
        if have is None:
            have = torch.zeros(0, layers, k, dtype=self.dtype)
        fill = torch.arange(k, dtype=self.dtype).expand(length - have.shape[0], layers, k)
        return torch.cat([have, fill])
