"""Run every benchmark (benchmarks/bench_*.py) one after the other: ``make bench``.

    python3 benchmarks/run_all.py            # full runs (tens of minutes on a 2-core box)
    python3 benchmarks/run_all.py --quick    # smoke runs, a few minutes
    python3 benchmarks/run_all.py --only node_step e2e

Each script runs in its own process (so one crash or hang does not take the
others down) with the same Python, writes its own results, and is listed with
its exit code and wall time. The targets the scripts report (the ``summary``
of their JSON) are gathered into benchmarks/results/run_all.json and .md
(``run_all.quick.*`` for ``--quick``). Exits non-zero if any script failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, LoadMonitor, machine_info, md_table, write_results

HERE = Path(__file__).resolve().parent


def scripts(only: list[str] | None) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        found = [p for p in found if any(o in p.stem for o in only)]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument("--only", nargs="+", help="run the scripts whose name contains one of these")
    ap.add_argument("--timeout-min", type=float, default=45.0, help="per-script time limit")
    args = ap.parse_args(argv)
    todo = scripts(args.only)
    if not todo:
        print("no benchmark matched", file=sys.stderr)
        return 2
    rows, targets = [], []
    with LoadMonitor() as load:
        for path in todo:
            cmd = [sys.executable, str(path)] + (["--quick"] if args.quick else [])
            print(f"\n=== {path.name} {'--quick' if args.quick else ''}", flush=True)
            t0 = time.monotonic()
            try:
                rc = subprocess.run(
                    cmd, check=False, cwd=HERE.parent, timeout=args.timeout_min * 60
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            wall = time.monotonic() - t0
            stem = f"{path.stem}.quick" if args.quick else path.stem
            res_json = RESULTS / f"{stem}.json"
            fresh = res_json.exists() and res_json.stat().st_mtime >= time.time() - wall - 1
            rows.append(
                {
                    "script": path.name,
                    "exit": rc,
                    "wall_s": round(wall, 1),
                    "results": f"results/{stem}.md" if fresh else "(none written)",
                }
            )
            if fresh:
                try:
                    for s in json.loads(res_json.read_text()).get("summary", []):
                        targets.append({"script": path.name, **s})
                except (ValueError, OSError):
                    pass
    md = [
        f"# run_all{' --quick' if args.quick else ''}: {len(rows)} benchmark scripts",
        "",
        load.line(),
        "",
        md_table(rows, ["script", "exit", "wall_s", "results"]),
        "",
    ]
    if targets:
        md += [
            "## Targets",
            "",
            md_table(targets, ["script", "benchmark", "ratio", "ratio_cpu", "target", "verdict"]),
            "",
        ]
    write_results(
        "run_all",
        {
            "quick": args.quick,
            "machine": machine_info(),
            "load": load.info(),
            "scripts": rows,
            "targets": targets,
        },
        "\n".join(md),
        quick=args.quick,
    )
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
