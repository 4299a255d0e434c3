"""`CurrentStream`: the executor's cheap lookup of the current CUDA stream is
``torch.cuda.current_stream`` — on the default stream, inside ``torch.cuda.stream``
blocks, after the block, and for more streams than it keeps."""

from __future__ import annotations

import torch

from flashplan.executor.flashinfer.streams import CurrentStream


def test_current_stream_follows_torch() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    current = CurrentStream(dev, capacity=2)
    assert current() == torch.cuda.current_stream(dev)
    streams = [torch.cuda.Stream(dev) for _ in range(4)]
    for _ in range(2):  # the second pass finds kept and dropped identities
        for s in streams:
            with torch.cuda.stream(s):
                got = current()
                assert got == s and got.cuda_stream == s.cuda_stream
            assert current() == torch.cuda.current_stream(dev)
    assert len(current._streams) <= 2
    # events recorded on the kept object order work on the current stream
    with torch.cuda.stream(streams[0]):
        a = torch.ones(1 << 20, device=dev)
        event = torch.cuda.Event()
        event.record(current())
    event.synchronize()
    assert float(a.sum()) == float(1 << 20)
