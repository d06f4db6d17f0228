"""A CUDA-event timeline of checkpoint offload: layer compute on the main stream, the D2H / H2D copies on the side
stream, and the main stream's stalls waiting for an H2D copy (an event recorded just before ``wait_event`` and one
just after: their distance is exactly the time the main stream could not run). A measuring instrument for
bench_memory.py --timeline (the library's offload only records into one when given it: ``mgr.timeline``).

    mgr = model._easy_context_offload; mgr.timeline = Timeline()
    ... one step ...
    print(mgr.timeline.summary()); mgr.timeline.chrome_trace("offload_trace.json")  # chrome://tracing, Perfetto
"""
from __future__ import annotations

import contextlib
import json
import os

import torch


class Timeline:
    def __init__(self):
        self.spans: list = []  # (track, name, start event, end event)

    @staticmethod
    def event(stream=None) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def add(self, track: str, name: str, start, end) -> None:
        self.spans.append((track, name, start, end))

    @contextlib.contextmanager
    def span(self, track: str, name: str, stream=None):
        start = self.event(stream)
        try:
            yield
        finally:
            self.add(track, name, start, self.event(stream))

    def rows(self) -> list[tuple[str, str, float, float]]:
        """(track, name, start ms, end ms) from the first event, after a device synchronize."""
        if not self.spans:
            return []
        torch.cuda.synchronize()
        t0 = min(self.spans, key=lambda s: self.spans[0][2].elapsed_time(s[2]))[2]
        return [(tr, nm, t0.elapsed_time(a), t0.elapsed_time(b)) for tr, nm, a, b in self.spans]

    def summary(self) -> dict:
        rows = self.rows()
        total = {tr: sum(b - a for t, _, a, b in rows if t == tr) for tr in ("compute", "d2h", "h2d", "stall")}
        wall = max((b for *_, b in rows), default=0.0) - min((a for *_, a, _ in rows), default=0.0)
        copies = total["d2h"] + total["h2d"]
        return {"step_ms": round(wall, 1), **{f"{k}_ms": round(v, 1) for k, v in total.items()},
                "copies_hidden": round(1 - total["stall"] / copies, 4) if copies else 1.0}

    def chrome_trace(self, path: str) -> None:
        tid = {"compute": 0, "stall": 1, "d2h": 2, "h2d": 3}
        ev = [{"name": nm, "ph": "X", "ts": a * 1e3, "dur": (b - a) * 1e3, "pid": 0, "tid": tid.get(tr, 9),
               "cat": tr} for tr, nm, a, b in self.rows()]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": ev, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)


__all__ = ["Timeline"]
