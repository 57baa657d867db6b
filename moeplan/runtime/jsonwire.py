"""JSON over torch.distributed: small objects exchanged between ranks as UTF-8 bytes in a
tensor. torch.distributed's object collectives (`all_gather_object`, `broadcast_object_list`)
pickle what they send and unpickle what they receive; these never do, so no rank runs code
another rank (or a tampered store) sent.

Its own module so that the checkpoint code and the trainer can both use it without importing
each other.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _json_bytes(obj: object, device: torch.device) -> torch.Tensor:
    data = json.dumps(obj, allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def all_gather_json(obj: object, device: torch.device, group: object = None) -> list:
    """Every rank's `obj` (of `group`, default the world), in rank order, sent as JSON bytes in
    a tensor (the object collectives of torch.distributed pickle; this never does)."""
    mine = _json_bytes(obj, device)
    n = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    top = max(1, max(int(s) for s in sizes))
    buf = torch.zeros(top, dtype=torch.uint8, device=device)
    buf[: mine.numel()] = mine
    bufs = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(b[: int(s)].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]


def broadcast_json(obj: object, device: torch.device, src: int = 0) -> object:
    """`obj` of rank `src` on every rank, as JSON bytes in a tensor (no pickle)."""
    mine = _json_bytes(obj, device) if dist.get_rank() == src else None
    n = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64, device=device)
    dist.broadcast(n, src=src)
    buf = mine if mine is not None else torch.empty(int(n), dtype=torch.uint8, device=device)
    if int(n):
        dist.broadcast(buf, src=src)
    return json.loads(buf.cpu().numpy().tobytes())
