"""`luwu top`'s line on a node whose state is out of core: rates between two samples, I/O wait per
step, buffer occupancy, and nothing for an in-RAM node."""

from luwu.cli.top import state_line, with_state_lines
from luwu.ops.monitor import NodeStatus, render_table

MB = 1_000_000


def _status(at: float, uptime: float, step: int, read: float, written: float, wait: float, **kw):
    detail = {
        "node": 0,
        "step": step,
        "uptime_s": uptime,
        "state_bytes_read": read,
        "state_bytes_written": written,
        "state_io_wait_s": wait,
        "state_buffer_bytes": kw.get("held", 50 * MB),
        "state_memory_bytes": kw.get("budget", 200 * MB),
    }
    return NodeStatus("tcp://127.0.0.1:1", up=True, detail=detail, at=at)


def test_in_ram_nodes_get_no_line():
    old_node = NodeStatus("tcp://127.0.0.1:1", up=True, detail={"node": 0, "step": 3}, at=1.0)
    fits = _status(1.0, 10.0, 3, 0.0, 0.0, 0.0, held=0.0)  # state_dir set, state fits the budget
    down = NodeStatus("tcp://127.0.0.1:1", up=False, error="no answer")
    assert state_line("0", old_node) == state_line("0", fits) == state_line("0", down) == ""
    table = render_table([old_node])
    assert with_state_lines(table, [old_node], {}) is table


def test_rates_since_start_then_between_samples():
    first = _status(100.0, 10.0, 4, 400 * MB, 100 * MB, 2.0)
    assert state_line("0", first) == (
        "node 0: state out of core: read 40.0 MB/s, written 10.0 MB/s, I/O wait 0.50 s/step, "
        "buffers 50.0 MB of 200.0 MB (25%)"
    )
    second = _status(102.0, 12.0, 6, 500 * MB, 160 * MB, 3.0, held=200 * MB)
    assert state_line("0", second, first) == (
        "node 0: state out of core: read 50.0 MB/s, written 30.0 MB/s, I/O wait 0.50 s/step, "
        "buffers 200.0 MB of 200.0 MB (100%)"
    )
    idle = _status(103.0, 13.0, 6, 500 * MB, 160 * MB, 3.0)
    assert "read 0 B/s, written 0 B/s, I/O wait 0.00 s (no step finished)" in state_line(
        "0", idle, second
    )


def test_a_restarted_node_is_rated_since_its_start():
    before = _status(100.0, 50.0, 40, 4000 * MB, 1000 * MB, 20.0)
    after = _status(101.0, 2.0, 2, 20 * MB, 10 * MB, 1.0)  # counters went back: a new process
    assert "read 10.0 MB/s, written 5.0 MB/s, I/O wait 0.50 s/step" in state_line(
        "0", after, before
    )
