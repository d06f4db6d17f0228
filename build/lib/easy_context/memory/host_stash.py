"""Where checkpoint offload keeps a layer input: fixed-size page-locked host chunks (``HostPool``) and one kept input
(``_Stash``: on the GPU, or copied to the chunks on a side stream and prefetched back). memory/offload.py drives them.
"""
from __future__ import annotations

import torch


class HostPool:
    """Fixed-size page-locked host chunks, reused across steps and sequence lengths.

    A kept layer input is stored as ``ceil(bytes / chunk_bytes)`` chunks, so one pool serves every length
    without re-pinning (pinning tens of GB takes seconds). Chunks are page-locked with cudaHostRegister
    on ordinary host memory rather than taken from torch's caching host allocator, so ``release()`` really
    returns them to the OS. Without CUDA the chunks are plain host memory (the CPU path stays exact).
    """

    def __init__(self, chunk_bytes: int = 64 << 20):
        self.chunk_bytes = int(chunk_bytes)
        self.free: list[torch.Tensor] = []
        self.registered: dict[int, torch.Tensor] = {}
        self.streams: list = []  # side streams whose copies may touch chunks (synchronised on release)

    def _new(self) -> torch.Tensor:
        buf = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        if not torch.cuda.is_available():
            return buf
        try:
            ok = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), self.chunk_bytes, 0)) == 0
        except Exception:
            ok = False
        if not ok:
            return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.registered[buf.data_ptr()] = buf
        return buf

    def take(self, nbytes: int) -> list:
        n = -(-nbytes // self.chunk_bytes)
        return [self.free.pop() if self.free else self._new() for _ in range(n)]

    def give(self, chunks: list):
        self.free.extend(chunks)

    def reserve(self, total_bytes: int):
        """Have at least ``total_bytes`` of free chunks (pin ahead of time, off the clock)."""
        need = -(-int(total_bytes) // self.chunk_bytes) - len(self.free)
        self.free.extend(self._new() for _ in range(max(0, need)))

    def release(self):
        """Unpin and free every free chunk."""
        for st in self.streams:
            st.synchronize()  # no copy may still read or write a chunk we unpin
        for b in self.free:
            if self.registered.pop(b.data_ptr(), None) is not None:
                torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
        self.free = []

    def nbytes(self) -> int:
        return len(self.free) * self.chunk_bytes


class _Stash:
    """One kept layer input: on the GPU, or copied in chunks to (pinned) host memory and prefetched back. ``mgr``:
    the ``CheckpointOffload`` (its pool, side stream and timeline)."""

    def __init__(self, mgr, x: torch.Tensor, offload: bool):
        self.mgr, self.shape, self.dtype, self.device = mgr, x.shape, x.dtype, x.device
        self.gpu = self.chunks = self.ev = None
        x = x.detach()
        if not offload:
            self.gpu = x
            return
        flat = x.contiguous().reshape(-1).view(torch.uint8)
        self.nbytes = flat.numel()
        self.chunks = mgr.pool.take(self.nbytes)
        if x.device.type != "cuda":  # CPU run: the same chunked copy, synchronous (exact)
            for off, c in self._pieces():
                n = min(self.mgr.pool.chunk_bytes, self.nbytes - off)
                c[:n].copy_(flat[off: off + n])
            return
        stream = mgr.stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))  # x is fully written
        tl = mgr.timeline
        start = tl.event(stream) if tl is not None else None
        with torch.cuda.stream(stream):
            for off, c in self._pieces():
                n = min(self.mgr.pool.chunk_bytes, self.nbytes - off)
                c[:n].copy_(flat[off: off + n], non_blocking=True)
        flat.record_stream(stream)  # the allocator may not reuse x's block before the copy ends
        self.ev = torch.cuda.Event(enable_timing=tl is not None)
        self.ev.record(stream)
        if tl is not None:
            tl.add("d2h", f"D2H {self.nbytes / 2**20:.0f} MiB", start, self.ev)

    def _pieces(self):
        return [(i * self.mgr.pool.chunk_bytes, c) for i, c in enumerate(self.chunks)]

    def _upload(self, out, non_blocking: bool):
        for off, c in self._pieces():
            n = min(self.mgr.pool.chunk_bytes, self.nbytes - off)
            out[off: off + n].copy_(c[:n], non_blocking=non_blocking)
        return out.view(self.dtype).view(self.shape)

    def prefetch(self):
        """Start the H2D copy on the side stream (no-op if kept on GPU / on CPU / already started)."""
        if self.gpu is not None or self.chunks is None or self.device.type != "cuda":
            return
        stream = self.mgr.stream(self.device)
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)  # on the main stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the block is free to overwrite
        tl = self.mgr.timeline
        start = tl.event(stream) if tl is not None else None
        with torch.cuda.stream(stream):
            self.gpu = self._upload(out, non_blocking=True)
        self.ev = torch.cuda.Event(enable_timing=tl is not None)
        self.ev.record(stream)
        if tl is not None:
            tl.add("h2d", f"H2D {self.nbytes / 2**20:.0f} MiB", start, self.ev)

    def get(self) -> torch.Tensor:
        if self.chunks is not None and self.device.type != "cuda":
            x = self._upload(torch.empty(self.nbytes, dtype=torch.uint8), non_blocking=False)
        else:
            self.prefetch()
            if self.ev is not None:
                main, tl = torch.cuda.current_stream(self.device), self.mgr.timeline
                before = tl.event(main) if tl is not None else None
                main.wait_event(self.ev)
                if tl is not None:  # the main stream's idle time waiting for this copy
                    tl.add("stall", "wait for H2D", before, tl.event(main))
            x = self.gpu
        self.release()
        return x

    def release(self):
        if self.chunks is not None:
            # a later write to these chunks is a D2H on the same side stream, ordered after this H2D
            self.mgr.pool.give(self.chunks)
        self.gpu = self.chunks = None


__all__ = ["HostPool"]
