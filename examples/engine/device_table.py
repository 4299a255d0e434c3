"""The engine's one page table on the model's device, kept for the life of the engine.

The host table (numpy int32 ``[max_running, max_pages]``, the engine's own bookkeeping) is
the truth. At the start of every step :meth:`DevicePageTable.send` copies it whole into the
same device tensor: on a GPU from one of two pinned slots, non-blocking and ordered on the
current stream after everything queued before it (so a step still running on the GPU reads
the ids it was planned with), each slot rewritten only after its last copy is done.

Keeping one tensor keeps the step free of allocations, and sending the table from pinned
memory keeps it free of waits for the GPU. Every ``apply`` takes the table it is given
and gathers the batch's page ids from it on the device.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DevicePageTable"]


class DevicePageTable:
    """One device copy of a host page table, refreshed in place each step.

    Args:
        shape: ``(rows, max_pages)`` of the host table.
        device: the model's device.
    """

    def __init__(self, shape: tuple[int, int], device: torch.device) -> None:
        self.pages = torch.full(shape, -1, dtype=torch.int32, device=device)
        self._cuda = device.type == "cuda"
        slots = 2 if self._cuda else 0
        self._slots = [torch.empty(shape, dtype=torch.int32).pin_memory() for _ in range(slots)]
        # an event not recorded yet counts as done
        self._copied = [torch.cuda.Event() for _ in self._slots]
        self._next = 0

    def send(self, table: np.ndarray) -> torch.Tensor:
        """Copy ``table`` (int32, this shape) into :attr:`pages`; returns :attr:`pages`.

        On a GPU the copy is queued on the current stream (no wait, except for a slot
        whose copy of two steps ago has not run yet); elsewhere it is done at once."""
        if not self._cuda:
            self.pages.copy_(torch.from_numpy(table))
            return self.pages
        k = self._next
        self._next ^= 1
        self._copied[k].synchronize()  # the slot's last copy (two steps ago) has run
        slot = self._slots[k]
        np.copyto(slot.numpy(), table)
        self.pages.copy_(slot, non_blocking=True)
        self._copied[k].record()
        return self.pages
