"""Packed rows dealt to ranks by a time-balanced table, one concern a file (imports run down the list): table.py (the
table, DispatchError, its route DISPATCH_KWARG, its checks), cost.py (per-token work, the fitted time model),
segments.py (boundaries moved between ranks; a deal's Estimate), solve.py (equal-chunk deals, the one pick rule),
plan.py (plan_dispatch, resolve: the public names), ring.py (the attention's ring over a table), ahead.py (tables
planned in a helper process). Import the module you need: this ``__init__`` imports nothing, so the geometry below
(packing, kernels/documents) reads ``table`` without loading the solver.
"""
