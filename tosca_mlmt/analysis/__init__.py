"""Offline analysis of runs and snapshots (``mlmt analyze``); no model is loaded.

* ``sources``: find and read run folders, snapshot folders and snapshot ids (read-only).
* ``tables``: pure functions from DataFrames to the report's tables.
* ``plots``: one PNG per figure (matplotlib, Agg canvas; no pyplot global state).
* ``report``: the Markdown report that holds the tables and links the PNGs.
"""
