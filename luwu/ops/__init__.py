"""Operations: the node daemons' life on a host, under the ``luwu`` command.

A training script never imports this package; the command line (:mod:`luwu.cli`) and the
deploy recipes do. :mod:`~luwu.ops.rundir` is the run directory and its pid files,
:mod:`~luwu.ops.daemons` starts and stops the daemons of one (``luwu up`` / ``luwu down``),
:mod:`~luwu.ops.supervisor` is their parent and restarts a daemon that dies,
:mod:`~luwu.ops.keyset` makes the job's CURVE keys and join secret and keeps secrets out of
files, logs and command lines, :mod:`~luwu.ops.cluster_file` writes the cluster file that
workers and tools read, and :mod:`~luwu.ops.monitor` asks the nodes for STATS
(``luwu status`` / ``luwu top``). Nothing here imports torch.
"""
