"""The library's benchmarks, run from the repository root as ``python -m benchmarks.<kind>.<script>``
(README.md beside this file: which script answers which question, and where its results go)."""
