"""The model's shape: library code in ``easy_context/cost_model/shape.py`` (re-exported here)."""
from ...cost_model.shape import Shape, load_shape, model_flops_per_token, shape_from_dict  # noqa: F401
