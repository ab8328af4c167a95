"""Many processes and long runs: the per-rank runtime and its reductions (``distributed.py``),
FSDP2 sharding (``sharding.py``), atomic checkpoints (``checkpoint.py``), SIGTERM preemption
(``preemption.py``), and the few private Lightning calls in one place (``lightning_compat.py``)."""
