"""The process mode: a telemetry process beside each rank samples, stores and computes live
figures, so that the training process shares no GIL with telemetry.

* ``engine.py``: :class:`~charllm_nemo.telemetry.process.engine.ProcessEngine`, the session's
  engine in this mode (the interface: telemetry/engine.py);
* ``parent.py``: :class:`~charllm_nemo.telemetry.process.parent.ProcessSampler`, the training
  process's handle: starts the child, writes marks and figure requests, reads answers, salvages
  what a dead child left;
* ``child.py``: the telemetry process itself: the sampling loop on its main thread, the
  collector on a second;
* ``ring.py``: the shared-memory block (sample ring, mark ring, names, figure slots) and its
  ordering rules;
* ``collector.py``: the child's store and live figures (takes samples and records from the
  block, answers figure requests with telemetry/attribution.py, writes the segments).

Nothing here is imported by ``import charllm_nemo.telemetry.process``: the child imports only
the light modules before it samples.
"""
