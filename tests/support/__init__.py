"""Test infrastructure shared by the system tests and the benchmarks: an emulated multi-host cluster of
network namespaces (``netns_cluster``, built on ``netns_base``). Imported as ``support`` with ``tests/``
on the path (the test configuration and the benchmark scripts put it there)."""
