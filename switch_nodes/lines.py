"""The lines a node prints on stdout for whoever started it (launcher, local cluster, studies).

Torch-free and ZeroMQ-free, so a supervisor can read them without loading the node's dependencies.
"""

#: Printed once the node's socket is bound, followed by its address: ``LUWU_NODE_READY tcp://...``.
READY_LINE = "LUWU_NODE_READY"
#: Printed once the metrics endpoint listens, followed by its URL: ``LUWU_METRICS_READY http://...``.
METRICS_LINE = "LUWU_METRICS_READY"
