"""train.py's view of ``easy_context.errors``: the same UsageError, ``fail`` defaulting to ``train.py``."""
from easy_context.errors import UsageError
from easy_context.errors import fail as _fail


def fail(msg: str, prog: str = "train.py", code: int = 2):
    _fail(msg, prog, code)


__all__ = ["UsageError", "fail"]
