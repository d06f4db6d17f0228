"""data_parallel: no sequence parallelism; attention stays the model's own (identity layout)."""
