"""Batch inference to files: ``feeder.predict`` and the ``feeder predict`` command.

* :mod:`~feeder.scoring.predictor`: ``predict()`` and ``PredictResult``: argument checks, then
  the steps below, in order.
* :mod:`~feeder.scoring.plan`: the model opened and checked against the source: which inputs are
  fed, which outputs and kept inputs are written.
* :mod:`~feeder.scoring.session`: ``PredictSession``: the model as each replica runs it (IOBinding per
  thread on the shared session, reused output buffers, the check that outputs are per row).
* :mod:`~feeder.scoring.destination`: the output folder: the rank's own, local or in a store,
  never inside the input.
* :mod:`~feeder.scoring.job`: one call's work on one output: its state checked, resumed from and
  written as parts are committed.
* :mod:`~feeder.scoring.replicas`: the replica threads running the model, and the progress bar.
* :mod:`~feeder.scoring.partwriter`: the writer thread: rows into Parquet part files.
* :mod:`~feeder.scoring.outputdir`: the output folder: the commit protocol (temporary name, fsync,
  rename, state replaced atomically), the completion marker and recovery after a crash.
* :mod:`~feeder.scoring.storeout`: the output in an object store (or on a ``filesystem=``): parts
  committed by replacing a manifest, under a lease.
* :mod:`~feeder.scoring.modelid`: the model's identity (hashes of its file and external data files).
* :mod:`~feeder.scoring.cli`: ``feeder predict MODEL DATA OUTPUT``.
"""
