"""The current CUDA stream, looked up at the cost of one C call.

``torch.cuda.current_stream(device)`` builds a new Python ``Stream`` object on every
call (device-index parsing, lazy-init checks, the object itself): about 5 µs of host
time on an H200 host, paid at every ``apply``. :class:`CurrentStream` asks torch's C
layer for the current stream's identity (``(stream_id, device_index, device_type)``,
what ``torch.cuda.current_stream`` itself reads) and hands out one ``Stream`` object
per identity, made once by ``torch.cuda.current_stream``. Two ``Stream`` objects of
one identity are the same CUDA stream, so recording events on the kept one is
recording on the current stream. If a torch build lacks that C entry point, every
lookup goes through ``torch.cuda.current_stream``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CurrentStream"]


class CurrentStream:
    """``torch.cuda.current_stream(device)`` for one device, with the stream objects
    kept per stream identity (at most ``capacity``; the oldest dropped).

    Args:
        device: a CUDA device with an index.
        capacity: stream identities kept (an engine uses a handful of streams).
    """

    def __init__(self, device: torch.device, capacity: int = 16) -> None:
        self.device = device
        self.capacity = capacity
        self._index = device.index
        self._identity: Callable[[int], tuple[int, int, int]] | None = getattr(
            torch._C, "_cuda_getCurrentStream", None
        )
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def __call__(self) -> torch.cuda.Stream:
        """The device's current stream (no sync, no allocation once seen)."""
        if self._identity is None:
            return torch.cuda.current_stream(self.device)
        key = self._identity(self._index)
        stream = self._streams.get(key)
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
            if len(self._streams) >= self.capacity:
                del self._streams[next(iter(self._streams))]
            self._streams[key] = stream
        return stream
