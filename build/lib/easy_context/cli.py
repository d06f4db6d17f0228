"""Entry-point wrapper shared by the scripts (eval_needle.py, eval_ppl.py)."""
from __future__ import annotations

import torch.distributed as dist

from .errors import UsageError, fail


def run_cli(main, prog: str):
    """Run ``main()``; a UsageError / ValueError / FileNotFoundError becomes one ``prog: error: ...`` line and exit 2.

    The process group is torn down either way (gloo aborts at interpreter exit otherwise).
    """
    try:
        result = main()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return result
    except (UsageError, ValueError, FileNotFoundError) as e:
        fail(str(e), prog)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
