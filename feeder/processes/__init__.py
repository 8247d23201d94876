"""Worker processes: ``fetch_fun`` run in other processes, its chunks back through shared memory.

``init_data_input_workers(..., num_worker_processes=N)`` uses this package instead of fetcher
threads (``feeder.fetchers``); the feed sees the same interface either way.

* :mod:`~feeder.processes.parent`: ``ProcFetchers``, the parent's side: starting the processes,
  stopping them, describing them (their stacks).
* :mod:`~feeder.processes.starting`: the start method, a registration's options, a Ctrl-C while
  the processes start.
* :mod:`~feeder.processes.receiver`: the parent's receiver threads: the slots a process fills
  turned into chunks on the source's queue, its failures into the source's.
* :mod:`~feeder.processes.child`: the loop that runs in a worker process: seed, ``worker_init_fun``,
  fetch, validate, assemble whole batches, write them once into shared memory.
* :mod:`~feeder.processes.shm`: the shared memory: sealed anonymous segments, the control page,
  the channel between parent and child.
* :mod:`~feeder.processes.sending`: how ``fetch_fun`` travels to a process (cloudpickle inside
  multiprocessing's own sending) and the check at registration.
"""
