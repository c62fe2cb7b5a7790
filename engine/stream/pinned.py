"""Host -> GPU copies through reused page-locked buffers: pinning a fresh tensor costs about a millisecond of host
time per call on an H200 (most of a graph-replayed tick's host budget), a reused buffer costs nothing. A shape copied
many times while the GPU is busy (eight sessions' window curves prepared while the ring's tick runs) gets more
buffers rather than a wait for the copy queued behind that tick."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BUFFERS_PER_SHAPE = 4  # buffers a shape starts with; more are pinned while all of them wait for their copies
MAX_BUFFERS_PER_SHAPE = 64  # then a copy waits for the oldest buffer's


@dataclass
class _Ring:
    buffers: list[torch.Tensor] = field(default_factory=list)
    copied: list[torch.cuda.Event] = field(default_factory=list)
    next: int = 0


class PinnedStaging:
    """Asynchronous copies of host tensors to one device. A buffer is written again only once the copy that read
    it has run (its event), so a host running ahead of the GPU never overwrites data still to be copied."""

    def __init__(self, device: torch.device):
        self.device = device
        self._rings: dict[tuple, _Ring] = {}

    def to_device(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new device tensor (in `dtype`, default the tensor's) holding `tensor`'s values; the host does not wait
        for queued GPU work. On a CPU device: the tensor itself, cast."""
        dtype = tensor.dtype if dtype is None else dtype
        if self.device.type != "cuda":
            return tensor.to(self.device, dtype)
        out = torch.empty(tensor.shape, device=self.device, dtype=dtype)
        self.copy(tensor, out)
        return out

    def copy(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """out.copy_(tensor) for a host `tensor` and a device `out`, queued on the current stream."""
        if self.device.type != "cuda":
            out.copy_(tensor)
            return
        ring = self._rings.setdefault((tuple(tensor.shape), tensor.dtype), _Ring())
        index = ring.next
        grow = len(ring.buffers) < BUFFERS_PER_SHAPE or (
            len(ring.buffers) < MAX_BUFFERS_PER_SHAPE and not ring.copied[index].query()
        )
        if grow:  # a new buffer in the ring's order, before the busy one (the oldest stays next-but-one)
            ring.buffers.insert(index, torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
            ring.copied.insert(index, torch.cuda.Event())
        else:
            ring.copied[index].synchronize()
        ring.next = (index + 1) % len(ring.buffers)
        staged = ring.buffers[index]
        staged.copy_(tensor)
        out.copy_(staged, non_blocking=True)
        ring.copied[index].record()
