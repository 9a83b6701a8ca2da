"""Pipeline stages (installed as tosca_mlmt.pipelines).

Every stage has one shape, ``stage(cfg, out, *, console=None, ...) -> <Stage>Result``:
``collect``, ``train_lower``, ``train_upper``, ``train_joint``, ``evaluate``, and ``analyze``
(which takes run folders and snapshots in place of a config). The training stages also take
``resume``, ``allow_drift`` and, where they read snapshots, ``verify``. Each one writes
through a ``support.rundir.RunDir``.
"""
