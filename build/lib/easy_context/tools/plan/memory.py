"""Peak memory of one candidate: library code in ``easy_context/cost_model/memory.py`` (re-exported here)."""
from ...cost_model.memory import (attn_output_bytes, attn_working_set, gpu_memory, host_memory,  # noqa: F401
                                  kv_width)
