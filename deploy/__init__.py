"""The deploy recipes that ship with the package: the worker example ``train_example.py`` and
``cluster.example.toml``, the cluster file it reads (``luwu up`` names them in its hint)."""
