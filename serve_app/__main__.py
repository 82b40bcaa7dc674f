"""The ``serve-app`` command (also ``python -m serve_app``): ``serve MODEL|FILE``,
``status``, ``check FILE``, ``materialize NAME``, ``gc``, ``metrics-table``,
``sizing-table``, ``local-cluster``, ``--version``."""

from __future__ import annotations

import argparse
import sys

from serve_app.config.profile import ProfileError, load_serve_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gc"]:
        from serve_app.cli.gc import main as gc_main

        return gc_main(argv[1:])
    from serve_app import __version__
    from serve_app.cli.quickstart import add_model_flags

    parser = argparse.ArgumentParser(prog="serve-app", description="MLX models on Ray Serve, "
                                     "OpenAI- and Anthropic-compatible, with a prefix cache")
    parser.add_argument("--version", action="version", version=f"serve_app {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a Serve config file's profiles and print "
                                         "their memory plans (refused if one cannot fit)")
    check.add_argument("config")
    check.add_argument("--hub", action="store_true",
                       help="read the size of hub models missing from the local Hugging Face "
                            "cache from the hub (config.json and the file listing only)")
    check.add_argument("--mac-gb", type=int, default=None, metavar="GB",
                       help="plan for a Mac with this much memory (16, 32, 64, 128...) "
                            "instead of this machine")
    mat = sub.add_parser("materialize", help="build an embedded model and print its path")
    mat.add_argument("name")
    sub.add_parser("gc", help="report (and with --apply clean) an SSD cache directory")
    sub.add_parser("metrics-table", help="print the table of metrics (docs/metrics.md)")
    sub.add_parser("sizing-table", help="print the table of what fits on a Mac (docs/mac.md)")
    lean = sub.add_parser(
        "serve", help="serve MODEL (an embedded name, a model directory or a Hugging Face "
                      "repo id) or a profile FILE.yaml, on a local Ray started without its "
                      "dashboard (~1 GB less resident memory)",
        description="MODEL: embedded:smollm2-135m, a model directory or a Hugging Face repo "
                    "id; the flags make a one-model profile, written to "
                    "~/.cache/serve_app/run/NAME.yaml and served like a FILE.yaml (whose "
                    "own settings the flags do not change).")
    lean.add_argument("config", metavar="MODEL|FILE.yaml")
    lean.add_argument("--dashboard", action="store_true",
                      help="keep Ray's dashboard (UI, `ray list`, `serve status`)")
    add_model_flags(lean)
    stat = sub.add_parser("status", help="what a running server is doing: each model's phase, "
                                         "memory, requests and cache hits")
    stat.add_argument("--url", default="http://127.0.0.1:8000")
    stat.add_argument("--api-key", default=None, help="or $SERVE_APP_API_KEY")
    local = sub.add_parser("local-cluster",
                           help="run a Ray cluster of several nodes on this machine (to try "
                                "configs/qwen-cluster.yaml without several Macs)")
    local.add_argument("--nodes", type=int, default=2)
    local.add_argument("--ssd-root", default=None,
                       help="node i keeps its SSD cache in SSD_ROOT/node-i (default: "
                            "~/.cache/serve_app/cluster, created 0700)")
    args = parser.parse_args(argv)

    if args.command == "check":
        try:
            apps = load_serve_config(args.config)
        except ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if check_drafts(args.config, apps) | check_parallel(args.config, apps):
            return 2
        return check_memory(args.config, apps, args.hub, args.mac_gb)
    if args.command == "status":
        from serve_app.cli.status import status

        code, report = status(args.url, args.api_key)
        print(report, file=sys.stderr if code == 2 else sys.stdout)
        return code
    if args.command == "serve":
        from serve_app.cli.quickstart import build_config, looks_like_config, write_config

        try:
            if not looks_like_config(args.config):
                args.config = str(write_config(build_config(args.config, args)))
                print(f"serve-app: serving {args.config} (a profile made from the flags)",
                      file=sys.stderr)
            load_serve_config(args.config)  # a bad profile is refused before Ray starts
        except ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        from serve_app.cli.launch import serve

        return serve(args.config, dashboard=args.dashboard)
    if args.command == "materialize":
        from serve_app.models.embedded import materialize
        from serve_app.models.wheels import MaterializeError, console_progress

        try:
            print(materialize(args.name, progress=console_progress(args.name)))
        except (ValueError, MaterializeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "local-cluster":
        from serve_app.cli.local_cluster import run_local_cluster

        return run_local_cluster(args.nodes, args.ssd_root)
    if args.command == "sizing-table":
        from serve_app.memory.sizing import sizing_table

        print(sizing_table(), end="")
        return 0
    if args.command == "metrics-table":
        from serve_app.metrics.table import markdown_table

        print(markdown_table(), end="")
        return 0
    return 2


def check_drafts(config: str, apps: list) -> bool:
    """Print (to stderr) every draft source that cannot draft for its model (a draft
    model with another tokenizer, ``mtp`` without an MTP head); True if any."""
    from serve_app.serving.service import draft_tokenizer_problem, mtp_head_problem

    bad = False
    for k, (_, profile) in enumerate(apps):
        for i, model in enumerate(profile.models):
            for key, problem in (("draft_model", draft_tokenizer_problem(model)),
                                 ("method", mtp_head_problem(model))):
                if problem:
                    print(f"error: {config}: applications[{k}].args.models[{i}]."
                          f"speculative.{key}: {problem}", file=sys.stderr)
                    bad = True
    return bad


def check_parallel(config: str, apps: list) -> bool:
    """Print (to stderr) every sharded model that cannot be sharded as asked (read from
    its config, local files only; a hub model not here is left to its load); True if any."""
    import json
    from pathlib import Path

    from serve_app.config.profile import source_kind
    from serve_app.parallel.support import parallel_problem
    from serve_app.serving.service import source_path

    bad = False
    for k, (_, profile) in enumerate(apps):
        for i, model in enumerate(profile.models):
            if model.parallel is None or source_kind(model.source) == "hub":
                continue
            path = Path(source_path(model.source))
            problem = parallel_problem(json.loads((path / "config.json").read_text()),
                                       model.parallel, path)
            if problem:
                key, why = problem
                print(f"error: {config}: applications[{k}].args.models[{i}].parallel.{key}: "
                      f"{why}", file=sys.stderr)
                bad = True
    return bad


def check_memory(config: str, apps: list, hub: bool, mac_gb: int | None = None) -> int:
    """Print each application's memory plan; 2 if one cannot fit (each reason on stderr).
    ``mac_gb``: plan for a Mac of that many GB (as the sizing table does), not this one."""
    from serve_app.memory.machine import MachineMemory, probe_machine
    from serve_app.memory.plan import describe
    from serve_app.memory.planning import plan_profile

    machine = probe_machine() if mac_gb is None else MachineMemory(mac_gb << 30)
    refused = False
    for name, profile in apps:
        plan = plan_profile(profile, machine, hub)
        models = ", ".join(m.name for m in profile.models)
        verdict = "ok" if plan.fits else "REFUSED (memory)"
        print(f"{config}: application {name!r} {verdict}: {models}")
        for line in describe(plan):
            print(line)
        for note in plan.notes:
            print(f"  note: {note}")
        for problem in plan.problems:
            print(f"error: {config}: application {name!r}: memory: {problem}", file=sys.stderr)
        refused = refused or not plan.fits
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
