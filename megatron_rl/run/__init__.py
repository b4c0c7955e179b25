"""The run's lifecycle: its folder, checkpoints, stop signals, time limits and metrics.

- `run_dir.py`: the run folder (config.yaml, resume checks: a folder holds this run or none);
- `checkpoint.py`: distributed checkpoints (async writes, atomic publish, retention, storage check);
- `operations.py`: between steps, whether to checkpoint and stop (time limit, signals, stop file,
  requeue), agreed by every rank;
- `signals.py`: SIGTERM/SIGUSR1 handling that only records a request;
- `metrics.py`: metrics.jsonl, the console line, optional TensorBoard/W&B.
Nothing here knows the RL algorithm: the trainer calls it.
"""
