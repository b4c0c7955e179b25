"""Tools on top of runs, beside the CLI: compare runs, plot curves, evaluate and export checkpoints,
and the supervised LM demo (`train-lm`). They read run folders and checkpoints; the training loop
never imports them.
"""
