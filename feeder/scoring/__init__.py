"""Batch inference to files: ``feeder.predict`` and the ``feeder predict`` command.

* :mod:`~feeder.scoring.predictor`: ``predict()`` and ``PredictResult``: argument checks, the
  replicas running the model, the progress bar, resuming from the output's state.
* :mod:`~feeder.scoring.partwriter`: the writer thread: rows into Parquet part files.
* :mod:`~feeder.scoring.outputdir`: the output folder: the commit protocol (temporary name, fsync,
  rename, state replaced atomically), the completion marker and recovery after a crash.
* :mod:`~feeder.scoring.modelid`: the model's identity (hashes of its file and external data files).
* :mod:`~feeder.scoring.cli`: ``feeder predict MODEL DATA OUTPUT``.
"""
