"""Offline analysis of runs and snapshots (``mlmt analyze``); no model is loaded.

* ``sources``: find and read run folders, snapshot folders and snapshot ids (read-only).
* ``tables``: pure functions from DataFrames to the report's tables.
* ``stats``: intervals and tests (bootstrap, McNemar, Wilson) for the tables and the evals.
* ``plots``, ``curves``: one PNG per figure (matplotlib, Agg canvas; no pyplot global state);
  ``curves`` holds the figures over logged steps (raw faint, smoothed on top).
* ``headline``: the report's first section, the result: before vs after from the eval folders, with
  ``mlmt eval --compare-to``'s numbers.
* ``captions``: what a figure's data is (training batches or held-out evals, decoding, n per point),
  and table cells as text (a missing value as "–").
* ``report``: the Markdown report that holds the tables and links the PNGs.
* ``html``: the self-contained HTML report (figures embedded, captions, sample episodes).
"""
