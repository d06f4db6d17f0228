"""The planner's constants: library code in ``easy_context/cost_model/constants.py`` (re-exported here)."""
from ...cost_model.constants import (PLANNED_CHECKPOINTING, CONSTANTS_FILE, ZERO, C, GiB, PlanUsageError,  # noqa: F401
                                     gpu_constants, load_constants)
