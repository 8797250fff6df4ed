"""ZeRO-1/2's gather-and-hold (:mod:`autopar.zero`): the optimizer steps a shard of each split
parameter, and the per-rank program reads a full compute copy, which is all-gathered again from
the shards over their replicas (bucketed as the gradients are) whenever a shard changed.

A shard changes when an optimizer steps it or something writes it (a load, an in-place edit).
Its version counters tell the second; a foreach optimizer's in-place ops on a DTensor parameter
bump no version counter of its local tensor, so the module marks the copies ``dirty`` after any
optimizer step over its parameters (``autopar.module.params``). Every rank of a replica group
steps alike, so all of them gather or none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.collectives import axes_group


class ZeroCopies:
    """name -> the compute copy the program reads (``full``) and the split's layout (``lay``), for
    every ZeRO-1/2-split parameter this rank holds; ``gather_if_changed`` refreshes the copies."""

    def __init__(self, device_mesh: DeviceMesh, bucket_bytes: int):
        self.full: dict[str, torch.Tensor] = {}
        self.lay: dict = {}
        self.device_mesh = device_mesh
        self.bucket_bytes = bucket_bytes
        self.seen: dict | None = None  # the shards' versions at the last gather
        self.dirty = False  # an optimizer stepped the shards since

    def __bool__(self) -> bool:
        return bool(self.lay)

    @staticmethod
    def versions(held: dict, users: dict) -> dict:
        """id -> version of each held shard (``held``: id -> (name, shard)); ``users``: id of a
        shard -> the DTensor parameter over it, whose own counter an optimizer bumps."""
        return {k: p._version + (users[k]._version if k in users else 0) for k, (_, p) in held.items()}

    def mark_seen(self, held: dict, users: dict) -> None:
        self.seen = self.versions(held, users) if self.lay else None

    @torch.no_grad()
    def gather_if_changed(self, held: dict, users: dict) -> None:
        """All-gather the shards of ``held`` (id -> (name, shard), in slot order) into their
        compute copies when the shards changed since the last gather."""
        if not self.lay:
            return
        if not self.dirty and self.versions(held, users) == self.seen:
            return
        self.dirty = False
        by_axes: dict[tuple, list] = {}
        for name, p in held.values():
            by_axes.setdefault(self.lay[name].axes, []).append((name, p))
        for axes, members in by_axes.items():
            cur, size = [], 0
            for m in members:
                cur.append(m)
                full = self.full[m[0]]
                size += full.numel() * full.element_size()  # buckets of compute-copy bytes, as GradSync's
                if size >= self.bucket_bytes or m is members[-1]:
                    self._gather_bucket(cur, axes_group(self.device_mesh, axes))
                    cur, size = [], 0
        self.seen = self.versions(held, users)

    def _gather_bucket(self, members, group) -> None:
        lays = [self.lay[name] for name, _ in members]
        n = lays[0].replicas
        flat = torch.cat([p.detach().movedim(lay.dim, 0).reshape(-1) for (_, p), lay in zip(members, lays)])
        out = flat.new_empty(n * flat.numel())
        dist.all_gather_single(out, flat, group=group)
        rows, off = out.view(n, flat.numel()), 0
        for (name, p), lay in zip(members, lays):
            k = p.numel()
            full = self.full[name]
            moved = [full.shape[lay.dim]] + [d for i, d in enumerate(full.shape) if i != lay.dim]
            full.copy_(rows[:, off:off + k].reshape(moved).movedim(0, lay.dim))
            off += k
