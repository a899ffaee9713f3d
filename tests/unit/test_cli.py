"""The ``luwu`` command line: it loads fast, refuses mistakes with exit code 2, and its output
(TOML, tables, hints) is what a user can use as is."""

from __future__ import annotations

import importlib.metadata
import io
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from luwu.cli import main
from luwu.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "cluster.example.toml"


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------- import cost


@pytest.mark.parametrize(
    "code",
    [
        "import luwu.cli",
        "from luwu.cli import main; main(['--help'])",
        "import luwu; luwu.ConfigError, luwu.LuwuError",
    ],
)
def test_the_command_line_does_not_import_torch(code):
    probe = f"import sys\n{code}\nprint('torch' in sys.modules, 'zmq' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False False", f"{code!r} imported torch or zmq"


def test_status_against_a_live_node_does_not_import_torch(tmp_path):
    """``luwu status`` asks a real node for STATS and prints the table without loading torch."""
    from luwu.cluster import local_cluster

    with local_cluster(1, job="statusjob") as cluster:
        cfg = tmp_path / "cluster.toml"
        cfg.write_text(f'[cluster]\nnodes = ["{cluster.addresses[0]}"]\njob = "statusjob"\n')
        probe = (
            "import sys\nfrom luwu.cli import main\n"
            f"rc = main(['status', '--config', {str(cfg)!r}])\n"
            "print(rc, 'torch' in sys.modules)"
        )
        r = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "0 False", r.stdout


def test_the_package_names_still_import():
    from luwu import ConfigError, LuwuError, Prefetcher, RemoteOptimizer, local_cluster

    assert issubclass(ConfigError, LuwuError) and callable(local_cluster)
    assert RemoteOptimizer.__module__ == "luwu.optimizer" and Prefetcher.__name__ == "Prefetcher"
    import luwu

    with pytest.raises(AttributeError):
        luwu.NoSuchThing  # noqa: B018


# ----------------------------------------------------------------- refusing mistakes


@pytest.mark.parametrize(
    "args, says",
    [
        (["plan", "--params", "1B", "--compute-ms", "100", "--wokers", "8"], "--wokers"),
        (["plan", "--params", "1.3", "billion", "--compute-ms", "100"], "billion"),
        (["keys", "--wokers", "3"], "--wokers"),
        (["keys", "--workers", "0"], "--workers"),
        (["down", "--bogus"], "--bogus"),
        (["down", "--run-dir", "/nonexistent", "--bogus"], "--bogus"),
        (["status", "--bogus"], "--bogus"),
        (["up", "--nodes", "2", "--bogus"], "--bogus"),
        (["node", "stray"], "stray"),
        (["config", "show", "--node.bind"], "needs a value"),
        (["demo", "--steps", "0"], "--steps"),
    ],
)
def test_unknown_arguments_and_bad_values_exit_2(capsys, tmp_path, args, says):
    if args[0] == "keys":
        args = [*args, "--out", str(tmp_path / "keys")]
    rc, _, err = run(capsys, *args)
    assert rc == 2 and says in err, err
    assert not (tmp_path / "keys").exists(), "a refused command wrote nothing"


@pytest.mark.parametrize(
    "args, says",
    [
        (["config", "show", "--nodee.bind=tcp://127.0.0.1:0"], "unknown config section 'nodee'"),
        (["config", "show", "--node.bnd=tcp://127.0.0.1:0"], "unknown config key node.bnd"),
        (["down", "--run-dir", "/nonexistent", "--node.bogus=1"], "unknown config key node.bogus"),
        (["status", "--cluster.nodes=tcp://127.0.0.1:1", "--cluster.job="], "cluster.job"),
    ],
)
def test_settings_flags_are_checked_against_the_config_tree(capsys, args, says):
    rc, _, err = run(capsys, *args)
    assert rc == 2 and says in err, err


def test_settings_flags_still_work(capsys):
    rc, out, err = run(capsys, "config", "show", "--node.staleness=3", "--node.mode", "async")
    assert rc == 0, err
    assert (
        "staleness = 3  # from --node.staleness" in out
        and 'mode = "async"  # from --node.mode' in out
    )


def test_version_comes_from_the_package_metadata(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"luwu {importlib.metadata.version('luwu-runtime')}"
    import luwu

    assert luwu.__version__ == importlib.metadata.version("luwu-runtime")


def _unreadable_prefix() -> list[str]:
    """A command prefix under which a chmod 000 file cannot be read: none for a normal user; for
    root (who reads it anyway), setpriv without the capabilities that bypass file modes."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip(
            "running as root, where chmod 000 does not stop reads, and no setpriv to drop the capabilities that allow them"
        )
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}"]


def _bad_config_path(tmp_path: Path, kind: str) -> tuple[str, list[str], str]:
    """(path, command prefix, what the error must say) of a cluster file that cannot be used."""
    path = tmp_path / "cluster.toml"
    if kind == "folder":
        path.mkdir()
        return str(path), [], "is a folder, not a TOML file"
    if kind == "unreadable":
        path.write_text('[cluster]\njob = "j"\n')
        path.chmod(0)
        return str(path), _unreadable_prefix(), "cannot be read: Permission denied"
    path.write_bytes(
        {"not-utf8": b'[cluster]\njob = "\xff"\n', "syntax": b"[cluster\njob = 1\n"}[kind]
    )
    return str(path), [], "is not valid TOML"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["folder", "unreadable", "not-utf8", "syntax"])
def test_a_cluster_file_that_cannot_be_used_exits_2_with_one_line(tmp_path, kind):
    """Every command that reads a cluster file, and load_config, say which file and what is wrong
    with it (exit code 2, one line, no traceback); nothing is started."""
    path, prefix, says = _bad_config_path(tmp_path, kind)
    probe = "from luwu.config import ConfigError, load_config\ntry:\n    load_config(__import__('sys').argv[1], env={})\nexcept ConfigError as exc:\n    print(exc)"
    r = subprocess.run(
        [*prefix, sys.executable, "-c", probe, path],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    message = r.stdout.strip()
    assert r.returncode == 0 and repr(path) in message and says in message, (r.stdout, r.stderr)
    run_dir = tmp_path / "run"
    for command in (
        ["up", "--nodes", "1", "--run-dir", str(run_dir)],
        ["node"],
        ["config", "show"],
        ["status"],
        ["down", "--run-dir", str(run_dir)],
    ):
        r = subprocess.run(
            [*prefix, sys.executable, "-m", "luwu", *command, "--config", path],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert r.returncode == 2 and r.stderr == f"luwu {command[0]}: error: {message}\n", (
            command,
            r.stderr,
        )
    assert not run_dir.exists(), "a refused `up` started nothing"


# ----------------------------------------------------------------- config show


def test_config_show_is_toml_that_loads_back(capsys, tmp_path):
    rc, out, err = run(
        capsys,
        "config",
        "show",
        "--config",
        str(EXAMPLE),
        "--node.mode=async",
        "--optimizer.delayed_update=true",
    )
    assert rc == 0, err
    assert "None" not in out and "False" not in out
    shown = tmp_path / "shown.toml"
    shown.write_text(out)
    back = load_config(str(shown), env={})
    cfg = load_config(
        str(EXAMPLE), env={}, argv=["--node.mode=async", "--optimizer.delayed_update=true"]
    )
    assert back.as_dict() == cfg.as_dict()


def test_config_show_hides_secrets_and_still_loads(capsys, tmp_path):
    import zmq

    public, secret = (k.decode() for k in zmq.curve_keypair())
    worker = zmq.curve_keypair()[0].decode()
    rc, out, err = run(
        capsys,
        "config",
        "show",
        f"--node.curve_public_key={public}",
        f"--node.curve_secret_key={secret}",
        f"--node.curve_authorized_keys={worker}",
    )
    assert rc == 0, err
    assert secret not in out and public in out and "curve_secret_key = <hidden>" in out
    (tmp_path / "shown.toml").write_text(out)
    back = load_config(
        str(tmp_path / "shown.toml"), env={"LUWU_NODE__CURVE_SECRET_KEY": secret}
    )  # the secret stays where it was
    assert back.node.curve_public_key == public and back.node.curve_secret_key == secret


def test_config_show_into_a_closed_pipe_exits_quietly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "luwu", "config", "show", "--config", str(EXAMPLE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    proc.stdout.close()  # the reader left before the first line, as `| head -0` does
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert proc.returncode != 0


def test_config_show_piped_into_head(tmp_path):
    cmd = f"{shlex.quote(sys.executable)} -m luwu config show --config {shlex.quote(str(EXAMPLE))} | head -n 2"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
    assert "Traceback" not in r.stderr, r.stderr


# ----------------------------------------------------------------- node's own address


def _cfg(*argv: str):
    return load_config(None, env={}, argv=list(argv))


def test_a_node_binds_its_own_entry_of_the_cluster_file():
    from luwu.cli.node import own_node_config

    nodes = "--cluster.nodes=tcp://127.0.0.1:7001,tcp://localhost:7002"
    assert own_node_config(_cfg(nodes, "--node.index=0")).bind == "tcp://127.0.0.1:7001"
    assert own_node_config(_cfg(nodes, "--node.index=1")).bind == "tcp://127.0.0.1:7002", (
        "a host name becomes its address"
    )
    assert (
        own_node_config(_cfg(nodes, "--node.index=1", "--node.bind=tcp://127.0.0.1:0")).bind
        == "tcp://127.0.0.1:0"
    ), "an explicit bind wins"
    assert own_node_config(_cfg(nodes)).bind == "tcp://127.0.0.1:0", "no index: the default"
    assert own_node_config(_cfg("--node.index=3")).bind == "tcp://127.0.0.1:0", (
        "no entry: the default"
    )


# ----------------------------------------------------------------- up's hint


def test_up_hints_a_training_command_that_works_with_the_shipped_example(tmp_path):
    from luwu.cli.updown import next_steps

    (train,) = [line for line in next_steps(tmp_path) if "torchrun" in line]
    words = train.split()
    script = Path(words[words.index("torchrun") + 3])
    assert (
        script.name == "train_example.py"
        and (script if script.is_absolute() else Path.cwd() / script).is_file()
    )
    assert words[words.index("--config") + 1] == str(tmp_path / "cluster.toml"), (
        "train_example.py requires --config"
    )


# ----------------------------------------------------------------- status and top


def _statuses():
    from luwu.ops.monitor import NodeStatus

    busy = dict(
        node=0,
        step=123456,
        workers=4,
        world_size=4,
        buckets=12,
        params=10**9,
        bytes_in=5e11,
        bytes_out=4e11,
        pushes=1e6,
        updates=1e5,
        uptime_s=90061.0,
        checkpoint_step=123000,
        checkpoint_age_s=185.0,
    )
    idle = dict(busy, node=1, workers=0, buckets=0, params=0)
    return [
        NodeStatus("tcp://node-0.example.internal:5555", True, busy, at=1.0),
        NodeStatus("tcp://127.0.0.1:5556", True, idle, at=1.0),
        NodeStatus("tcp://10.0.0.13:5557", False, error="no answer within 2 s"),
    ]


def _render(width: int, **kw) -> str:
    from rich.console import Console

    from luwu.ops.monitor import render_table

    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(
        render_table(
            _statuses(),
            title="LuWu job x (cluster.toml); rates averaged since each node started",
            width=width,
            **kw,
        )
    )
    return console.export_text()


@pytest.mark.parametrize("width", [80, 200])
def test_status_table_is_readable_at_80_columns(width):
    text = _render(
        width, restarts={"tcp://127.0.0.1:5556": 3, "tcp://node-0.example.internal:5555": 0}
    )
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text, "nothing is cut off"
    for address in ("tcp://127.0.0.1:5556", "tcp://10.0.0.13:5557"):
        assert address in text
    assert "tcp://node-0.example" in text and ".internal:5555" in text, (
        "a long address wraps, whole"
    )
    for column in ("state", "step", "workers", "in/s", "out/s", "uptime"):
        assert column in text
    assert "restarts 3" in text if width < 120 else "restarts" in text
    assert "node 1: idle: no worker has said HELLO" in " ".join(line.strip() for line in lines)
    assert "node 2: no answer within 2 s" in text


def test_status_json_has_the_restart_count_and_idle_reason():
    from luwu.ops.monitor import row

    busy, idle, down = _statuses()
    assert row(busy, restarts=2)["restarts"] == 2 and row(busy)["idle"] is None
    assert "no worker has said HELLO" in row(idle)["idle"]
    assert row(down, restarts=1)["restarts"] == 1


def test_restart_counts_come_from_the_supervisor_state(tmp_path):
    from luwu.ops.monitor import restart_counts
    from luwu.ops.rundir import write_state

    write_state(
        tmp_path,
        {
            "nodes": [
                {"index": 0, "address": "tcp://127.0.0.1:1", "restarts": 2},
                {"index": 1, "address": "", "restarts": 0},
            ]
        },
    )
    assert restart_counts(tmp_path) == {"tcp://127.0.0.1:1": 2}
    assert restart_counts(tmp_path / "missing") == {}


def test_status_and_plan_share_one_unit_family():
    from luwu.units import human_bytes

    assert human_bytes(267.2e6) == "267.2 MB"  # what `luwu plan` prints for 267.2e6 bytes
    assert human_bytes(999) == "999 B" and human_bytes(1.5e9) == "1.5 GB"
    assert "5.6 MB" in _render(200), "status: bytes/s in the same decimal units"


def test_config_files_layer_in_order(capsys, tmp_path):
    """--config twice: the shared cluster file, then a worker's own file over it (a later file's setting wins)."""
    shared, own = tmp_path / "cluster.toml", tmp_path / "worker1.toml"
    shared.write_text(
        '[cluster]\njob = "j"\nnodes = ["tcp://n0:1", "tcp://n1:2"]\n[transport]\ntimeout_s = 30.0\n'
    )
    own.write_text("[transport]\ntimeout_s = 45.0\n")
    rc, out, err = run(capsys, "config", "show", "--config", str(shared), "--config", str(own))
    assert rc == 0, err
    assert f"timeout_s = 45.0  # from {own}" in out and f'job = "j"  # from {shared}' in out
    cfg = load_config([str(shared), str(own)], env={})
    assert cfg.transport.timeout_s == 45.0 and cfg.cluster.nodes == ["tcp://n0:1", "tcp://n1:2"]
    assert load_config([str(own), str(shared)], env={}).transport.timeout_s == 30.0
