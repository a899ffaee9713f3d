"""The benchmark scripts as a package, so the tests import their real code (``from benchmarks import
convergence``) instead of loading files by path. Each script still runs on its own:
``python benchmarks/<name>.py``."""
