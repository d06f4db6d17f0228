"""Training support for train.py: flags, data, model loading, optimizer/schedule, DeepSpeed config,
atomic checkpoints, metrics, and a tiny local model/tokenizer/corpus for the demo and tests.

Modules: args, errors, data, modeling, optim, parallel, checkpoint, metrics, toy.
"""
