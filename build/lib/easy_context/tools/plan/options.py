"""A candidate and its setting: library code in ``easy_context/cost_model/options.py`` (re-exported here)."""
from ...cost_model.options import Env, Option, layout_problem, mode_of  # noqa: F401
