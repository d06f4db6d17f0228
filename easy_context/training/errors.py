"""One-line user errors: raised anywhere during set-up, printed once as ``train.py: error: ...``."""
import os
import sys


class UsageError(Exception):
    """Bad input the user can fix (flag, path, data). Reported as one line, exit status 2 (or ``code``)."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def fail(msg: str, prog: str = "train.py", code: int = 2):
    """Print ``prog: error: msg`` on one line (global rank 0 only) and exit non-zero on every rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
    sys.exit(code)
