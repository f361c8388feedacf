"""Tensor-parallel ranks of one engine (E22): the leader's group (group.py), the worker process
(worker.py), the step messages (messages.py), the collectives (comm.py) and the ranks' KV pools
in shared memory (shm.py). The model's split and its TP-invariant reductions: pdserve/model/tp.py."""
