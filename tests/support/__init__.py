"""Helpers of the multi-process and threaded tests: the functions spawned children run
(``mp_workers``, ``mp_lifecycle``, ``ops_workers``, ``peer_workers``; children import them
by module name, from ``tests/`` on ``sys.path``), waits and joins with a timeout
(``waits``), a garbage collection forced under a lock (``gc_locks``), and the GPUs
this process sees, named for a child's ``CUDA_VISIBLE_DEVICES`` (``gpus``)."""
