"""One-line user errors for every CLI (train.py, prepare_data.py, the evals, ``python -m easy_context``):
raised anywhere during set-up, printed once as ``PROG: error: ...``. No heavy imports: usable before torch loads."""
import os
import sys


class UsageError(Exception):
    """Bad input the user can fix (flag, path, data). Reported as one line, exit status 2 (or ``code``)."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def fail(msg: str, prog: str, code: int = 2):
    """Print ``prog: error: msg`` on one line (global rank 0 only) and exit non-zero on every rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
    sys.exit(code)
