"""The analytical cost model of a training step: what ``python -m easy_context plan`` (tools/plan) searches over and
``memory/auto.py`` chooses checkpointing with, as library code both import.

Files: ``constants.py`` (plan_constants.json, fixed choices), ``shape.py`` (config -> shape, parameters, FLOPs),
``hybrid.py`` (recurrent layer kinds of hybrids: parameters, state-math FLOPs, state exchange, working set),
``options.py`` (a candidate and the setting), ``memory.py`` (host and GPU peaks), ``step_time.py`` (compute,
sequence-parallel and ZeRO communication, optimizer), ``predict.py`` (one candidate's row).

This ``__init__`` imports nothing: ``cost_model.constants`` loads without torch or the modes.
"""
