"""Where the seconds of `fuser serve ENGINE_DIR` before its load go (the breakdown's "imports"
line): each phase of the launch, in a fresh process per run, and the largest imports.

    python benchmarks/serve_imports.py [--runs 3] [--top 15] [--out FILE.json]

Each run starts `python -X importtime` on the launch's own steps, as fuser/server/cli.py runs
them up to the load: the interpreter's start, `import fuser.cli` (torch, the fused ops, the
load path), the parser and thread setting, the serve extra's imports (FastAPI, uvicorn,
prometheus_client), the HTTP app and its runner, binding and starting uvicorn's thread, and
the imports that open the engine. The table gives each phase's median over the runs; the
imports are the first run's largest by cumulative time, each where another package first
imported it, and a line says which compiler modules were imported before the load (none of
sympy, Dynamo, Inductor and transformers should be: tests/test_imports.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILER_MODULES = ["sympy", "torch.fx.experimental.symbolic_shapes", "torch._dynamo",
                    "torch._inductor", "transformers"]

# The launch's steps up to the load (fuser/server/cli.py run_serve, open_engine), timed.
CHILD = """
import json, os, sys, time
from pathlib import Path

def age():
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")

phases = {"interpreter start": age()}
last = time.perf_counter()

def mark(name):
    global last
    now = time.perf_counter()
    phases[name] = now - last
    last = now

import fuser.cli
mark("import fuser.cli")
args = fuser.cli.build_parser().parse_args(["serve", sys.argv[1], "--port", "0"])
fuser.cli.set_threads(args.threads)
mark("parser, threads")
from fuser.server import cli
cli._check_args(args)
mark("fastapi, uvicorn, prometheus_client")
from fuser.server.app import create_app
from fuser.server.runner import ServerThread, bind
mark("app, runner imports")
server = ServerThread(create_app(None, None, "x"), sock=bind(args.host, args.port))
server.start()
mark("bind, app, HTTP server start")
import fuser
from fuser.launch import build_engine_from_args, command_line_buckets, is_engine_dir
mark("open_engine's imports")
server.stop()
print(json.dumps({"phases": phases, "modules": sorted(sys.modules)}))
"""


def parse_importtime(text: str) -> list[tuple[str, int, str | None]]:
    """(module, cumulative us, first importer) of every line of -X importtime's output."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split(":", 1)[1].split("|")
        rows.append(((len(name) - len(name.lstrip())) // 2, name.strip(), int(cumulative)))
    out = []
    for i, (depth, name, cumulative) in enumerate(rows):  # a parent follows its children
        parent = next((rows[j][1] for j in range(i + 1, len(rows)) if rows[j][0] < depth), None)
        out.append((name, cumulative, parent))
    return out


def largest_imports(rows: list[tuple[str, int, str | None]], top: int
                    ) -> list[tuple[str, float, str | None]]:
    """The `top` largest imports (seconds) that another package (or the script) started."""
    crossing = [(name, cumulative / 1e6, parent) for name, cumulative, parent in rows
                if parent is None or parent.split(".")[0] != name.split(".")[0]]
    return sorted(crossing, key=lambda row: -row[1])[:top]


def run_once(engine_dir: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD, engine_dir],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the launch's steps failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes (default: 3)")
    parser.add_argument("--top", type=int, default=15, help="imports listed (default: 15)")
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as somewhere:  # the command's PATH: only checked to exist
        runs = [run_once(somewhere) for _ in range(args.runs)]
    names = list(runs[0][0]["phases"])
    phases = {n: statistics.median(r["phases"][n] for r, _ in runs) for n in names}
    imports = largest_imports(parse_importtime(runs[0][1]), args.top)
    compiler = [m for m in COMPILER_MODULES if m in runs[0][0]["modules"]]
    width = max(map(len, names))
    print(f"fuser serve before its load, median of {args.runs} fresh processes (seconds):")
    for name, seconds in phases.items():
        print(f"  {name:<{width}} {seconds:6.2f}")
    print(f"  {'total':<{width}} {sum(phases.values()):6.2f}")
    print("largest imports (cumulative seconds, first importer), first run:")
    for name, seconds, parent in imports:
        print(f"  {seconds:6.2f} {name} <- {parent or '(the launch)'}")
    print(f"compiler modules imported before the load: {', '.join(compiler) or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"phases": phases, "imports": imports,
                                              "compiler_modules": compiler}, indent=2))


if __name__ == "__main__":
    main()
