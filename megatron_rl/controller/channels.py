"""Control-plane messages between executors: pickled objects over gloo point-to-point.

Sends are non-blocking: a generator posts its rollouts and goes on to the next weight sync or batch, which is
what lets it run ahead of the trainer (a blocking send would wait for the trainer to reach the matching receive
while the trainer waits for the generator in the weight sync: a deadlock).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist


class Outbox:
    """Non-blocking sends to one peer, kept alive until completed (messages arrive in order)."""

    def __init__(self, dst: int, group):
        self.dst, self.group = dst, group
        self._inflight: list = []

    def send(self, obj) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [dist.isend(size, self.dst, group=self.group), dist.isend(payload, self.dst, group=self.group)]
        self._inflight.append((works, size, payload))
        self._inflight = [w for w in self._inflight if not all(x.is_completed() for x in w[0])]

    def flush(self) -> None:
        for works, _, _ in self._inflight:
            for w in works:
                w.wait()
        self._inflight.clear()


def recv_object(src: int, group):
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())
