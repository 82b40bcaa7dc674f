"""Run every benchmark in sequence, then write a Markdown report with plots.

Each bench runs as its own subprocess (``python -m bench.<name> --model M --out
DIR/<name>-<M>.json``), one after the other so that no two share the CPU; its
output goes to ``DIR/logs/<name>-<M>.log``. A bench that fails (or runs past
``--timeout``) is recorded in ``DIR/runs.json`` with its log tail and the next
one runs. A bench with ``VARIANTS`` also runs each of them on its first model, into
``DIR/<name>-<M>-<variant>.json`` (multiturn: 1K-token turns after a 4.6K-token system
prompt). The machine (platform, CPU, memory, library versions, git commit) goes
to ``DIR/machine.json``; ``bench/report.py`` turns it all into ``DIR/REPORT.md``.

    python -m bench                          # everything, into bench/results/<UTC date>
    python -m bench --quick --only agents    # a smaller run of one bench
    python -m bench --report-only --out DIR  # re-render DIR/REPORT.md from its JSON
    python -m bench --only serving,traces --serving-models smollm2-135m \
        --traces-models smollm2-135m         # the real model (issue 28), ~20 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from bench.devserver import descendants
from bench.report import BENCHES, MACHINE, MULTITURN_1K_TURNS, RUNS, write_report

REPO = Path(__file__).resolve().parents[1]
CACHE_MODELS = "tiny-hybrid,tiny-hybrid-bf16"
SERVING_MODELS = "tiny-hybrid"
LOG_TAIL_LINES = 40

# Smaller settings for --quick, used where a bench has no --quick of its own; each
# flag is passed only if the bench's --help lists it (a bench's options may change).
QUICK: dict[str, list[tuple[str, str | None]]] = {
    "multiturn": [("--turns", "3"), ("--system-tokens", "500"), ("--user-tokens", "100"),
                  ("--gen", "8")],
    "agents": [("--sessions", "4"), ("--turns", "2"), ("--system-tokens", "500"),
               ("--user-tokens", "100"), ("--gen", "8")],
    "restart": [("--turns", "3"), ("--system-tokens", "500"), ("--user-tokens", "100"),
                ("--gen", "8"), ("--long-turns", "0")],
    "checkpoints": [("--tokens", "1024"), ("--intervals", "256,1024"), ("--rounds", "1")],
    "serving": [("--tokens", "64"), ("--repeats", "1")],
    "cluster": [("--sessions", "2"), ("--turns", "2"), ("--system-tokens", "300"),
                ("--user-tokens", "100"), ("--gen", "8"), ("--fetch-tokens", "1024")],
    "structured": [("--repeats", "1")],
    "traces": [("--quick", None)],  # the bench's own --quick is used first anyway
    "lookup": [("--quick", None)],
}
# Benches whose model is fixed: four cluster arms take long; the grammar cost is per token;
# the trace replay runs three servers; the store lookup loads no model; thinking needs a
# model whose template opens the thought.
FIXED_MODELS = {"cluster": "tiny-hybrid", "structured": "tiny-dense", "traces": "tiny-hybrid",
                "lookup": "store", "speculative": "tiny-dense", "thinking": "tiny-hybrid-mtp",
                "vision": "tiny-vl"}
# Flags a bench always gets here: the runner runs speculative decoding's controlled draft on
# the tiny models (a minute); its SmolLM2 workloads and HTTP part (an hour on this CPU) run on
# their own (``python -m bench.speculative``).
ALWAYS = {"speculative": ["--part", "controlled"]}
# A second configuration of a bench, run on the first of the bench's models after its plain
# runs, into ``<bench>-<model>-<variant>.json``: (variant, its flags, its flags with --quick,
# which replace the values of the same QUICK options). Issue 21: a replay whose turns are ~1K
# tokens after a ~4.6K-token system prompt, where each turn's new tokens dominate its TTFT.
VARIANTS: dict[str, list[tuple[str, list[str], list[str]]]] = {
    "multiturn": [(MULTITURN_1K_TURNS,
                   ["--turns", "6", "--system-tokens", "4600", "--user-tokens", "1000",
                    "--goal", "0.95"],
                   ["--system-tokens", "1200", "--user-tokens", "250", "--goal", "0.95"])],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default bench/results/<UTC date>)")
    parser.add_argument("--only", default=",".join(BENCHES),
                        help=f"comma-separated benches to run (default all: {','.join(BENCHES)})")
    parser.add_argument("--models", default=CACHE_MODELS,
                        help="models of multiturn, agents, restart and checkpoints "
                             f"(default {CACHE_MODELS}); multiturn's 1K-token-turn "
                             "replay runs on the first")
    parser.add_argument("--serving-models", default=SERVING_MODELS,
                        help=f"models of the serving bench (default {SERVING_MODELS}; "
                             "e.g. tiny-hybrid,tiny-dense)")
    parser.add_argument("--traces-models", default=FIXED_MODELS["traces"],
                        help=f"models of the trace replay (default {FIXED_MODELS['traces']}; "
                             "smollm2-135m gets its own smaller scale)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller settings (a bench's own --quick where it has one): "
                             "checks the plumbing, not the goals")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing; re-render DIR/REPORT.md from the JSON in DIR")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one bench may run before it is stopped (default 3600)")
    args = parser.parse_args(argv)
    args.only = [b for b in args.only.split(",") if b]
    unknown = sorted(set(args.only) - set(BENCHES))
    if unknown:
        parser.error(f"unknown bench(es) {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    if args.out is None:
        args.out = REPO / "bench" / "results" / datetime.now(UTC).strftime("%Y-%m-%d")
    args.out = args.out.resolve()  # the benches run from the repository root
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(bench, model, variant) in run order: the bench order of ``BENCHES``, each bench's
    models, then its ``VARIANTS`` on its first model (variant "" is the plain run)."""
    models = {"serving": args.serving_models, **FIXED_MODELS, "traces": args.traces_models}
    out = []
    for bench in BENCHES:
        if bench not in args.only:
            continue
        names = [m for m in models.get(bench, args.models).split(",") if m]
        out += [(bench, model, "") for model in names]
        out += [(bench, names[0], variant) for variant, _, _ in VARIANTS.get(bench, [])
                if names]
    return out


def bench_help(bench: str) -> str:
    """The bench's ``--help``: which options it really has ("" if it cannot say; then
    the bench runs with its defaults, and fails on its own if it is broken)."""
    try:
        return subprocess.run([sys.executable, "-m", f"bench.{bench}", "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def has_option(help_text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text) is not None


def merge_flags(flags: list[str], override: list[str]) -> list[str]:
    """``flags`` with each ``--option VALUE`` pair of ``override`` replacing the same
    option's value (or appended): one value per option on the command line."""
    out = list(flags)
    for option, value in zip(override[::2], override[1::2], strict=True):
        if option in out and out.index(option) + 1 < len(out):
            out[out.index(option) + 1] = value
        else:
            out += [option, value]
    return out


def variant_flags(bench: str, variant: str, help_text: str, quick: bool) -> list[str]:
    """A variant's flags (its --quick ones with ``quick``) that the bench accepts."""
    flags: list[str] = []
    for name, full, small in VARIANTS.get(bench, []):
        if name == variant:
            given = small if quick else full
            for option, value in zip(given[::2], given[1::2], strict=True):
                if not help_text or has_option(help_text, option):
                    flags += [option, value]
    return flags


def quick_flags(bench: str, help_text: str) -> list[str]:
    """The bench's own ``--quick`` if it has one, else the ``QUICK`` settings it accepts."""
    if has_option(help_text, "--quick"):
        return ["--quick"]
    flags: list[str] = []
    for option, value in QUICK.get(bench, []):
        if has_option(help_text, option):
            flags += [option] if value is None else [option, value]
    return flags


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a bench that ran too long: SIGINT first, so its ``finally`` blocks stop the
    servers it started; then SIGKILL its process group and those of its descendants
    (only what this run started)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        # Its servers run in sessions of their own (ServerProcess): find them first.
        groups = {proc.pid}
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        proc.wait()


def display_path(path: Path) -> str:
    """Relative to the repository when inside it: a command to copy from the report."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run_bench(bench: str, model: str, directory: Path, extra: list[str],
              timeout: float, quick: bool = False, variant: str = "") -> dict:
    """One bench as a subprocess; its record for ``runs.json`` (its ``model`` is the JSON's
    label: the model, with ``-<variant>`` for a second configuration)."""
    label = f"{model}-{variant}" if variant else model
    out = directory / f"{bench}-{label}.json"
    log = directory / "logs" / f"{bench}-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # a stale result must not pass for this run's
    argv = ["-m", f"bench.{bench}", "--model", model, "--out", str(out),
            *ALWAYS.get(bench, []), *extra]
    shown = " ".join(["python", *argv]).replace(str(out), display_path(out))
    print(f"[bench] {shown}", flush=True)
    tic = time.monotonic()
    with log.open("w") as f:
        # Its own session, so a timeout can stop its whole process group; then Ctrl-C no
        # longer reaches it by itself, hence the KeyboardInterrupt below.
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 and out.exists() else "failed"
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc, status = proc.returncode, "timeout"
        except KeyboardInterrupt:
            stop_group(proc)
            raise
    seconds = time.monotonic() - tic
    print(f"[bench] {bench} {label}: {status} in {seconds:.0f} s", flush=True)
    return {"bench": bench, "model": label, "status": status, "returncode": rc, "quick": quick,
            "variant": variant,
            "seconds": seconds, "command": shown, "log": str(log.relative_to(directory)),
            "out": out.name, "log_tail": "" if status == "ok" else log_tail(log)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:  # macOS
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], text=True,
                              capture_output=True, timeout=10).stdout.strip()
    except OSError:
        return platform.processor()


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    """HEAD, marked ``+dirty`` when tracked files differ: the numbers belong to that tree."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "unknown"


def machine_info() -> dict:
    """What the numbers depend on, recorded next to them."""
    return {"recorded": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "memory_bytes": memory_bytes(), "python": platform.python_version(),
            "mlx": version("mlx"), "mlx-lm": version("mlx-lm"), "ray": version("ray"),
            "git_commit": git_commit()}


def read_runs(directory: Path) -> dict[str, dict]:
    try:
        return json.loads((directory / RUNS).read_text()).get("runs", {})
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def run_all(args: argparse.Namespace) -> bool:
    """Every planned bench in turn; ``runs.json`` is rewritten after each, so that an
    interrupted run still leaves a report-able directory. True when all passed."""
    runs = read_runs(args.out)  # keep earlier records of benches not rerun (--only)
    helps: dict[str, str] = {}
    ok = True
    for bench, model, variant in plan(args):
        extra: list[str] = []
        if args.quick or variant:
            helps.setdefault(bench, bench_help(bench))
        if args.quick:
            extra = quick_flags(bench, helps[bench])
        if variant:
            extra = merge_flags(extra, variant_flags(bench, variant, helps[bench], args.quick))
        record = run_bench(bench, model, args.out, extra, args.timeout, args.quick, variant)
        runs[f"{bench}-{record['model']}"] = record
        ok &= record["status"] == "ok"
        write_json(args.out / RUNS, {"runs": runs})
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok = True
    if args.report_only and not args.out.is_dir():
        print(f"[bench] no results directory {args.out}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        if not (args.out / MACHINE).exists():
            write_json(args.out / MACHINE, {**machine_info(),
                                            "note": "recorded when the report was rendered"})
    else:
        write_json(args.out / MACHINE, machine_info())
        ok = run_all(args)
    print(f"[bench] report: {write_report(args.out)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
