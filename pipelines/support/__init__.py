"""What every stage leans on and no stage owns: the stage driver, the run folder, provenance, the timeline.

The stages (``pipelines/collect.py``, ``train_lower.py``, ...) are orchestration; the code they
share lives here so a reader of a stage sees only its own steps.

- ``stage.py``: the one shape of a stage and ``drive``, its loop.
- ``rundir.py``: the run folder (``RunDir``): writable check, lock, ``config.yaml``, metrics rewind,
  atomic writes.
- ``drift.py``: what a ``--resume`` may change from the run's config, and what ``eval``/``chat``/
  ``export --run`` warn about when they change what the run trained with.
- ``provenance.py``: the software header of a run's records and the manifest of every snapshot.
- ``timeline.py``: train-joint's one metrics timeline, its round lines and progress bar.
- ``snapshots.py``: what ``mlmt snapshots`` and ``mlmt setup`` ask of the library (the CLI reaches
  the library only through ``pipelines/``).
"""
