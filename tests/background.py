"""A command started now and waited for later, so a test can run something beside it (a one-process reference beside
a multi-rank launch: on 2 cores one process leaves a core idle). Output goes to temporary files: a child never blocks
on a full pipe while the test is busy elsewhere."""
from __future__ import annotations

import subprocess
import tempfile
import time


class Background:
    def __init__(self, cmd: list[str], env: dict, cwd, timeout: float):
        self.cmd, self.deadline = cmd, time.monotonic() + timeout
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.out, stderr=self.err,
                                     stdin=subprocess.DEVNULL, text=True)
        self.done = None

    def wait(self) -> subprocess.CompletedProcess:
        """Its exit code and output (``subprocess.run``'s result); past the deadline it is stopped and this raises."""
        if self.done is None:
            try:
                self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            finally:
                self.stop()
            self.out.seek(0)
            self.err.seek(0)
            self.done = subprocess.CompletedProcess(self.cmd, self.proc.returncode, self.out.read(), self.err.read())
        return self.done

    def stop(self) -> None:
        """End it if it still runs (SIGTERM: torchrun and accelerate pass it on to their workers; then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
