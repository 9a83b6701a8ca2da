"""The snapshot store: immutable, content-addressed dataset snapshots of episodes.

A snapshot is a folder ``<root>/<id>/`` holding ``episodes.parquet``, ``turns.parquet`` and
``manifest.json``; its id is a hash of what the data is and means, so the same episodes from the
same settings get the same id, and every reader can tell an edited or damaged one
(docs/reference/snapshot-format.md).

* ``snapshot``: writing one snapshot (built aside, renamed into place in one step) and reading it
  back as tables or typed ``Episode`` records (``load_snapshot``, ``Snapshot``).
* ``manifest``: the format versions, what the id stands for (``snapshot_id``), building a manifest
  and reading one back checked for shape.
* ``verify``: re-hashing a folder against its manifest (sizes, hashes, id, ``snapshot_id`` column).
* ``tables``: ``Episode``/``Turn`` records to Arrow tables and back, and the value digest the id hashes.
* ``index``: finding snapshots at any depth under a folder, resolving id prefixes, and one line
  per snapshot for listings.

Readable episode records (``tosca_mlmt.samples``) and the typed records (``tosca_mlmt.records``)
live outside: they are about episodes, not about how they are stored.
"""

from tosca_mlmt.store.index import (environment_of, find_snapshot_dirs, full_ids, matching_ids, open_snapshot,
                                    resolve_snapshot, row_line, snapshot_rows, terminal_safe)
from tosca_mlmt.store.manifest import read_manifest
from tosca_mlmt.store.snapshot import load_snapshot, snapshot_path, write_snapshot
from tosca_mlmt.store.verify import check_snapshot, verify_snapshot

__all__ = ["check_snapshot", "environment_of", "find_snapshot_dirs", "full_ids", "load_snapshot", "matching_ids",
           "open_snapshot", "read_manifest", "resolve_snapshot", "row_line", "snapshot_path", "snapshot_rows",
           "terminal_safe", "verify_snapshot", "write_snapshot"]
