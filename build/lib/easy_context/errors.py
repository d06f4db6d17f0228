"""One-line user errors for every CLI (train.py, prepare_data.py, the evals, ``python -m easy_context``):
raised anywhere during set-up, printed once as ``PROG: error: ...``. No heavy imports at module level: usable before
torch loads (under a launcher, ``fail`` imports torch.distributed to pick the one rank that prints)."""
import os
import sys


class UsageError(Exception):
    """Bad input the user can fix (flag, path, data). Reported as one line, exit status 2 (or ``code``)."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def fail(msg: str, prog: str, code: int = 2):
    """Print ``prog: error: msg`` on one line (one rank: ``first_to_report``) and exit non-zero on every rank."""
    if first_to_report("usage-error"):
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
    sys.exit(code)


def first_to_report(what: str) -> bool:
    """Whether this rank prints a line every rank would print alike. Under a launcher the first rank to get here (a
    counter in the launch's store): rank 0 alone is not enough, as the launcher stops the other ranks when the first
    one exits, and rank 0 may be that other rank. Without a launcher, or when the store does not answer: rank 0."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_PORT" not in os.environ:
        return os.environ.get("RANK", "0") == "0"
    try:
        import datetime

        import torch.distributed as dist
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=datetime.timedelta(seconds=5))
        key = (f"easy_context/{what}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - no store: rank 0 speaks
        return os.environ.get("RANK", "0") == "0"
