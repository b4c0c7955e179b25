"""Learner -> rollout-engine weight transfer: the only bridge between `learner/` and `rollout/`.

`export` yields HF-named full tensors from the (TP/PP/EP-sharded) learner through mbridge, in
size-bounded buckets; one module per transport sends them: `sync_distributed` (a process group
of the learner's rank 0 and the servers: NCCL on GPU, gloo on CPU), `sync_tensor` (tensor
handles over HTTP, for servers sharing the learner's devices), `sync_disk` (a HF checkpoint on
shared storage, the fallback).
"""
