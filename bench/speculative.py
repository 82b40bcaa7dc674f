"""Speculative decoding against plain decoding, side by side in one run, same weights.

Two parts, both driving our ``Engine`` in-process (the machinery itself, no HTTP), plus
``mlx_lm.server`` over HTTP where it applies (``--http``):

1. **Controlled draft** on the tiny random-weight models (``tiny-dense``, ``tiny-hybrid``):
   a draft that proposes the plain token with probability ``alpha`` (``ControlledDraft``),
   depth ``k`` fixed, one stream. For each alpha: decode tok/s against plain, tokens per
   verify step, and the expected speedup ``(1 - alpha^(k+1)) / (1 - alpha) / c(k+1)``
   where ``c(k+1)`` is what a verify step of ``k + 1`` positions costs over a plain step,
   measured in the engine itself at alpha 1 (every draft kept, no rollback: a step costs
   ``(k + 1) / speedup``); the probe the adaptive depth uses (``VerifyCost.measure``, bare
   forwards) is reported beside it.
2. **Workloads** on a real model (``embedded:smollm2-135m``), temperature 0, each arm fed
   the same prompts, rounds interleaved (ABAB...), medians of rounds:
   (a) a two-turn coding task: it writes a class, then rewrites it with one method added
   (the second turn is measured); (b) an edit of a file given in the prompt; (c)
   open-ended answers; (d) 8 concurrent streams of (c). Arms: ``plain``, ``ngram k=4`` and
   ``ngram k=8`` at fixed depth, and ``ngram adaptive`` (the profile's default settings).
   Reported per arm: decode tok/s per row (first token to last), tokens per verify step,
   acceptance, and whether the tokens are identical to plain's.

Goals (reported, never asserted): controlled alpha 0.8, k 4 within 20% of expected on
both tiny models; ngram on the rewrite >= 2.5 tokens per verify step with identical
tokens; the default (adaptive) settings >= 0.95x plain on open-ended answers, one stream
and 8.

3. **Over HTTP** (``http``): the rewrite and an open-ended answer, streamed, to our server
   (plain, ngram k=8, ngram adaptive: three models of one ``serve run``) and to
   ``mlx_lm.server`` plain and with ``--draft-model`` (the same weights drafting for
   themselves), each measured with the others frozen; decode tok/s over
   ``mlx_lm.server``'s, and whether the text is the same.

4. **MTP** (``mtp``): the model's own MTP head on ``tiny-hybrid-mtp`` (a Qwen3.5-layout
   checkpoint with random weights, so its drafts are almost never right: this measures
   what the machinery costs, not a speedup), one stream and four, arms plain, ``mtp k=1``
   and ``k=3`` fixed, and ``mtp adaptive``, which must fall back to about plain.

Usage: python -m bench.speculative [--quick] [--rounds N] [--out PATH] [--plot PATH]
       [--part controlled|workloads|http|mtp|all]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx_lm

from bench.common import emit
from serve_app.models.embedded import materialize
from serve_app.serving.drafts import ControlledDraft, DraftSource, MTPDraft, NgramDraft
from serve_app.serving.engine import Engine
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.speculative import (
    SpeculationSettings,
    Speculator,
    VerifyCost,
    expected_tokens,
)

ALPHAS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
GOALS = {"controlled_within": 0.20, "rewrite_tokens_per_step": 2.5, "default_vs_plain": 0.95}

CLASS_TASK = ("Write a Python class `Inventory` that tracks items and their quantities, with "
              "methods add, remove, count and total, each with a docstring. Only the code.")
REWRITE_TASK = ("Rewrite the whole class exactly as it is, adding one method `clear` that "
                "removes every item. Only the code.")
FILE = '''def parse(line):
    """Split a CSV line into fields."""
    fields = []
    for part in line.split(","):
        fields.append(part.strip())
    return fields


def total(rows, column):
    """Sum one numeric column over all rows."""
    result = 0
    for row in rows:
        result += float(row[column])
    return result
'''
EDIT_TASK = ("Here is a file:\n\n```python\n" + FILE + "```\n\nRename the function `total` "
             "to `column_sum` and give me the whole file back. Only the code.")
OPEN_TASKS = ("Tell me a story about a lighthouse keeper.", "Explain how rain forms.",
              "Describe a walk through a busy market.", "Why do cats purr?",
              "Write a letter to a friend about a trip to the sea.",
              "What makes a good breakfast?", "Describe the sound of a forest at night.",
              "Tell me about the history of bread.")


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.done = threading.Event()
        self.error: str | None = None

    def __call__(self, event: EngineEvent) -> None:
        if event.token is not None:
            self.tokens.append(event.token)
            self.times.append(event.at)
        if event.error:
            self.error = event.error
        if event.finish_reason or event.error:
            self.done.set()

    @property
    def decode_tps(self) -> float | None:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return None
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


@dataclass
class Arm:
    name: str
    source: DraftSource | None
    k: int = 4
    adaptive: bool = False
    rollback: str = "mixers"


def make_engine(model, stops: set[int], arm: Arm, max_batch: int = 8) -> Engine:
    spec = None
    if arm.source is not None:
        spec = Speculator(arm.source, SpeculationSettings(arm.k, arm.adaptive, arm.rollback),
                          stop_tokens=stops)
    engine = Engine(model, stop_tokens=stops, max_batch_size=max_batch,
                    max_queued_requests=64, speculator=spec)
    engine.wait_ready(600)
    return engine


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[Collector]:
    out = [Collector() for _ in prompts]
    for prompt, c in zip(prompts, out, strict=True):
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens), c)
    for c in out:
        c.done.wait()
        if c.error:
            raise RuntimeError(c.error)
    return out


def step_stats(before, after) -> dict:
    rows = after.drafting_row_steps - before.drafting_row_steps
    drafted = after.drafted_tokens - before.drafted_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    return {"verify_steps": after.verify_steps - before.verify_steps,
            "tokens_per_verify_step": 1 + accepted / rows if rows else None,
            "acceptance": accepted / drafted if drafted else None,
            "decode_steps": after.decode_steps - before.decode_steps,
            "generated": after.generated_tokens - before.generated_tokens}


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- part 1: controlled draft --------------------------------------------------------


def controlled(name: str, home: Path, k: int, tokens: int, rounds: int,
               rollback: str = "mixers") -> dict:
    model, tokenizer = mlx_lm.load(str(materialize(name, home)))
    stops = set(tokenizer.eos_token_ids)
    prompt = tokenizer.encode("controlled draft bench " * 4)
    plain_engine = make_engine(model, stops, Arm("plain", None))
    ref = run(plain_engine, [prompt], tokens)[0]
    references = {tuple(prompt): ref.tokens}
    cost = VerifyCost.measure(model, [1], k + 1, context=len(prompt))
    c = cost.ratio(1, k + 1)
    engines = {alpha: make_engine(model, stops, Arm(
        f"alpha {alpha}", ControlledDraft(references, alpha, model.args.vocab_size, seed=7),
        k, rollback=rollback)) for alpha in ALPHAS}
    plain_tps: list[float | None] = []
    spec_tps: dict[float, list[float | None]] = {a: [] for a in ALPHAS}
    steps: dict[float, dict] = {}
    identical = True
    for _ in range(rounds):
        plain_tps.append(run(plain_engine, [prompt], tokens)[0].decode_tps)
        for alpha, engine in engines.items():
            before = engine.snapshot()
            got = run(engine, [prompt], tokens)[0]
            identical &= got.tokens == ref.tokens
            spec_tps[alpha].append(got.decode_tps)
            steps[alpha] = step_stats(before, engine.snapshot())
    for engine in [plain_engine, *engines.values()]:
        engine.shutdown()
    base = median(plain_tps)
    full = median(spec_tps[1.0])
    # The verify cost as the engine pays it: at alpha 1 every step verifies k + 1 positions
    # and keeps them all (no rollback), so a step costs (k + 1) / speedup plain steps.
    engine_c = (k + 1) * base / full if base and full else None
    rows = []
    for alpha in ALPHAS:
        tps = median(spec_tps[alpha])
        speedup = tps / base if tps and base else None
        expected = expected_tokens(alpha, k) / engine_c if engine_c else None
        rows.append({"alpha": alpha, "decode_tps": tps, "speedup": speedup,
                     "expected_speedup": expected,
                     "expected_speedup_probe": expected_tokens(alpha, k) / c,
                     "off_expected": (speedup / expected - 1) if speedup and expected
                     else None, **steps[alpha]})
    return {"model": name, "k": k, "tokens": tokens, "rounds": rounds, "rollback": rollback,
            "plain_decode_tps": base, "verify_cost_engine": engine_c,
            "verify_cost_probe": c, "verify_cost_probe_by_positions": cost.ratios[1],
            "identical": identical, "rows": rows}


# ---- part 4: the model's own MTP head ---------------------------------------------------


def mtp(name: str, home: Path, tokens: int, rounds: int) -> dict:
    from serve_app.models.mtp import load_mtp_head

    path = materialize(name, home)
    model, tokenizer = mlx_lm.load(str(path))
    head, parts = load_mtp_head(model, path)
    stops = set(tokenizer.eos_token_ids)

    def source() -> DraftSource:
        return MTPDraft(head, parts.embed, parts.logits)

    arms = [Arm("plain", None), Arm("mtp k=1", source(), 1), Arm("mtp k=3", source(), 3),
            Arm("mtp adaptive", source(), 3, adaptive=True)]
    out: dict = {"model": name, "tokens": tokens, "rounds": rounds, "streams": {}}
    for streams in (1, 4):
        prompts = [tokenizer.encode(f"mtp bench {i}: " + "words and more words " * 4)
                   for i in range(streams)]
        engines = {}
        for arm in arms:
            if arm.source is not None:
                arm.source = source()  # its own per-request state
            engines[arm.name] = make_engine(model, stops, arm, max_batch=4)
        ref = [c.tokens for c in run(engines["plain"], prompts, tokens)]
        tps: dict[str, list] = {a.name: [] for a in arms}
        stats: dict[str, dict] = {}
        identical = dict.fromkeys(tps, True)
        for _ in range(rounds):
            for arm in arms:
                engine = engines[arm.name]
                before = engine.snapshot()
                got = run(engine, prompts, tokens)
                identical[arm.name] &= [c.tokens for c in got] == ref
                tps[arm.name].append(median([c.decode_tps for c in got]))
                stats[arm.name] = step_stats(before, engine.snapshot())
        for engine in engines.values():
            engine.shutdown()
        base = median(tps["plain"])
        out["streams"][streams] = {
            a: {"row_decode_tps": median(t), "vs_plain": (median(t) or 0) / base if base
                else None, "identical": identical[a], **stats[a]} for a, t in tps.items()}
    return out


# ---- part 2: workloads on a real model -------------------------------------------------


def chat(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def workloads(name: str, home: Path, rounds: int, quick: bool) -> dict:
    model, tokenizer = mlx_lm.load(str(materialize(name, home)))
    stops = set(tokenizer.eos_token_ids)
    long_tokens = 160 if quick else 320
    arms = [Arm("plain", None), Arm("ngram k=4", NgramDraft(), 4),
            Arm("ngram k=8", NgramDraft(), 8),
            Arm("ngram adaptive", NgramDraft(), 4, adaptive=True)]
    engines = {arm.name: make_engine(model, stops, arm) for arm in arms}
    # The rewrite's first turn: the class as the model writes it (plain, temperature 0).
    first = [{"role": "user", "content": CLASS_TASK}]
    written = run(engines["plain"], [chat(tokenizer, first)], long_tokens)[0]
    rewrite = chat(tokenizer, [*first, {"role": "assistant",
                                        "content": tokenizer.decode(written.tokens)},
                               {"role": "user", "content": REWRITE_TASK}])
    edit = chat(tokenizer, [{"role": "user", "content": EDIT_TASK}])
    opens = [chat(tokenizer, [{"role": "user", "content": t}]) for t in OPEN_TASKS]
    open_tokens = 64 if quick else 128
    tasks = {
        "rewrite own class": ([rewrite], long_tokens),
        "edit a file in the prompt": ([edit], long_tokens // 2),
        "open-ended answer": ([opens[0]], open_tokens),
        "8 streams open-ended": (opens, open_tokens),
    }
    results: dict[str, dict[str, dict]] = {t: {} for t in tasks}
    reference: dict[str, list[list[int]]] = {}
    samples: dict[tuple[str, str], list] = {}
    for rnd in range(rounds):
        order = arms if rnd % 2 == 0 else list(reversed(arms))
        for task, (prompts, max_tokens) in tasks.items():
            for arm in order:
                engine = engines[arm.name]
                before = engine.snapshot()
                tic = time.perf_counter()
                got = run(engine, prompts, max_tokens)
                wall = time.perf_counter() - tic
                stats = step_stats(before, engine.snapshot())
                outs = [c.tokens for c in got]
                if arm.name == "plain":
                    reference.setdefault(task, outs)
                samples.setdefault((task, arm.name), []).append({
                    "row_tps": median([c.decode_tps for c in got]),
                    "aggregate_tps": sum(len(o) for o in outs) / wall,
                    "outs": outs, **stats})
    for (task, arm), runs in samples.items():
        ref = reference[task]
        results[task][arm] = {
            "row_decode_tps": median([r["row_tps"] for r in runs]),
            "aggregate_tps": median([r["aggregate_tps"] for r in runs]),
            "tokens_per_verify_step": median([r["tokens_per_verify_step"] for r in runs]),
            "acceptance": median([r["acceptance"] for r in runs]),
            "verify_steps": sum(r["verify_steps"] for r in runs),
            "identical": all(r["outs"] == ref for r in runs),
            "tokens": sum(len(o) for o in runs[0]["outs"]),
        }
    for task in results:
        base = results[task]["plain"]
        for arm in results[task].values():
            for key in ("row_decode_tps", "aggregate_tps"):
                arm[f"{key}_vs_plain"] = (arm[key] / base[key]
                                          if arm[key] and base[key] else None)
    adaptive = engines["ngram adaptive"].speculator
    cost = adaptive.cost.ratios if adaptive is not None else {}
    for engine in engines.values():
        engine.shutdown()
    return {"model": name, "rounds": rounds, "verify_cost_measured": cost, "tasks": results}


# ---- part 3: over HTTP, against mlx_lm.server ----------------------------------------


def http(name: str, home: Path | None, rounds: int, quick: bool) -> dict:
    """The rewrite and an open-ended answer, streamed over HTTP, to our server (one
    ``serve run``, the same weights served as three models: plain, ngram at a fixed depth,
    ngram adaptive) and to ``mlx_lm.server``, plain and with ``--draft-model`` (the same
    weights drafting for themselves: acceptance near 1 at temperature 0, so what it shows is
    its machinery's cost; it turns batching off). Each measured with the others frozen."""
    from bench.common import (
        ServerProcess,
        free_port,
        start_mlx_lm_server,
        stream_chat,
        workdir,
    )
    from bench.devserver import write_config
    from bench.serving_real import others_frozen
    from serve_app.serving.service import source_path

    model_dir = Path(source_path(f"embedded:{name}", home))
    long_tokens = 160 if quick else 320
    fixed = {"method": "ngram", "num_draft_tokens": 8, "adaptive": False}
    adaptive = {"method": "ngram", "num_draft_tokens": 4, "adaptive": True}
    ours_models = {"plain": None, "ngram k=8": fixed, "ngram adaptive": adaptive}
    names = {arm: f"{name}-{i}" for i, arm in enumerate(ours_models)}
    with workdir() as tmp:
        port = free_port()
        config = write_config(tmp / "ours.yaml", port, [
            {"name": names[arm], "source": f"embedded:{name}", "max_tokens": long_tokens,
             "context_length": 4096, "cache": {"enabled": True},
             **({"speculative": spec} if spec else {})}
            for arm, spec in ours_models.items()], cache_store={"ssd_dir": str(tmp / "kv")})
        servers: dict[str, ServerProcess] = {}
        try:
            servers["ours"] = ServerProcess.serve_run(config, port, tmp / "ours.log")
            servers["ours"].wait_ready(list(names.values()))
            servers["mlx_lm.server"] = start_mlx_lm_server(tmp, "mlx", model_dir, long_tokens)
            servers["mlx_lm.server --draft-model"] = start_mlx_lm_server(
                tmp, "mlx-draft", model_dir, long_tokens, "--draft-model", str(model_dir),
                "--num-draft-tokens", "4")
            arms = [("ours", names[a], a) for a in ours_models] + [
                (srv, str(model_dir), srv) for srv in servers if srv != "ours"]
            first = [{"role": "user", "content": CLASS_TASK}]
            with others_frozen(servers, "ours"):
                written = stream_chat(servers["ours"].base_url, {
                    "model": names["plain"], "messages": first, "max_tokens": long_tokens,
                    "temperature": 0})["text"]
            tasks = {"rewrite own class": ([*first, {"role": "assistant", "content": written},
                                            {"role": "user", "content": REWRITE_TASK}],
                                           long_tokens),
                     "open-ended answer": ([{"role": "user", "content": OPEN_TASKS[1]}], 64)}
            samples: dict[tuple[str, str], list[dict]] = {}
            for rnd in range(rounds + 1):  # round 0 warms every arm up (prefix caches too)
                for server, model, arm in (arms if rnd % 2 else list(reversed(arms))):
                    with others_frozen(servers, server):
                        for task, (messages, max_tokens) in tasks.items():
                            r = stream_chat(servers[server].base_url, {
                                "model": model, "messages": messages,
                                "max_tokens": max_tokens, "temperature": 0})
                            if rnd:
                                samples.setdefault((task, arm), []).append(r)
        finally:
            for server in servers.values():
                server.stop()
    out: dict[str, dict] = {}
    for (task, arm), runs in samples.items():
        tps = [(r["tokens"] - 1) / r["decode_s"] for r in runs if r["decode_s"] > 0]
        out.setdefault(task, {})[arm] = {
            "decode_tps": median(tps), "tokens": runs[0]["tokens"],
            "text_same_as_ours_plain": None, "texts": [r["text"] for r in runs]}
    for arms_of in out.values():
        base = arms_of["plain"]
        ref = base["texts"][0]
        for arm in arms_of.values():
            arm["text_same_as_ours_plain"] = all(t == ref for t in arm.pop("texts"))
            arm["vs_mlx_lm_server"] = (arm["decode_tps"] / arms_of["mlx_lm.server"]["decode_tps"]
                                       if arm["decode_tps"] else None)
    return {"model": name, "rounds": rounds, "tasks": out}


# ---- report ----------------------------------------------------------------------------


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def summary(result: dict) -> str:
    lines = []
    for part in result.get("controlled", []):
        lines.append(f"controlled draft on {part['model']} (rollback {part['rollback']}), "
                     f"k={part['k']}: plain "
                     f"{fmt(part['plain_decode_tps'], '.1f')} tok/s, verify cost c(k+1) = "
                     f"{fmt(part['verify_cost_engine'])} in the engine (probe "
                     f"{fmt(part['verify_cost_probe'])}), identical: {part['identical']}")
        lines.append("  alpha  speedup  expected  off   tokens/step")
        for r in part["rows"]:
            lines.append(f"  {r['alpha']:<5}  {fmt(r['speedup']):>7}  "
                         f"{fmt(r['expected_speedup']):>8}  {fmt(r['off_expected'], '+.0%'):>4}"
                         f"  {fmt(r['tokens_per_verify_step']):>11}")
    work = result.get("workloads")
    if work:
        lines.append(f"workloads on {work['model']} (medians of {work['rounds']} rounds):")
        for task, arms in work["tasks"].items():
            lines.append(f"  {task}:")
            for arm, r in arms.items():
                lines.append(f"    {arm:<15} row {fmt(r['row_decode_tps'], '.1f'):>6} tok/s "
                             f"({fmt(r['row_decode_tps_vs_plain'])}x)  aggregate "
                             f"{fmt(r['aggregate_tps'], '.1f'):>6} "
                             f"({fmt(r['aggregate_tps_vs_plain'])}x)  tokens/step "
                             f"{fmt(r['tokens_per_verify_step'])}  acceptance "
                             f"{fmt(r['acceptance'])}  identical {r['identical']}")
    web = result.get("http")
    if web:
        lines.append(f"over HTTP on {web['model']} (medians of {web['rounds']} rounds):")
        for task, arms in web["tasks"].items():
            lines.append(f"  {task}:")
            for arm, r in arms.items():
                lines.append(f"    {arm:<28} decode {fmt(r['decode_tps'], '.1f'):>6} tok/s "
                             f"({fmt(r['vs_mlx_lm_server'])}x mlx_lm.server)  same text as "
                             f"ours plain: {r['text_same_as_ours_plain']}")
    head = result.get("mtp")
    if head:
        lines.append(f"MTP head on {head['model']} (random weights; medians of "
                     f"{head['rounds']} rounds):")
        for streams, arms in head["streams"].items():
            lines.append(f"  {streams} stream(s):")
            for arm, r in arms.items():
                lines.append(f"    {arm:<13} row {fmt(r['row_decode_tps'], '.1f'):>6} tok/s "
                             f"({fmt(r['vs_plain'])}x plain)  acceptance "
                             f"{fmt(r['acceptance'])}  identical {r['identical']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for part in result.get("controlled", []):
        alphas = [r["alpha"] for r in part["rows"]]
        line, = ax.plot(alphas, [r["speedup"] for r in part["rows"]], "o-",
                        label=f"{part['model']} ({part['rollback']}) measured")
        ax.plot(alphas, [r["expected_speedup"] for r in part["rows"]], "--",
                color=line.get_color(), label=f"{part['model']} expected")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("alpha (probability a drafted token is the plain one)")
    ax.set_ylabel("decode speedup over plain")
    ax.set_title("Controlled draft, k = 4, one stream (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("controlled", "workloads", "http", "mtp", "all"),
                        default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="smollm2-135m", help="the workloads' real model")
    parser.add_argument("--home", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    home = args.home
    result: dict = {"host": {"machine": platform.machine(), "system": platform.system(),
                             "python": platform.python_version()},
                    "goals": GOALS}
    if args.part in ("controlled", "all"):
        tokens = 48 if args.quick else 128
        result["controlled"] = [
            controlled("tiny-dense", home, 4, tokens, args.rounds),
            # recurrent state rolled back by its mixers alone, and by the whole model
            controlled("tiny-hybrid", home, 4, tokens, args.rounds, "mixers"),
            controlled("tiny-hybrid", home, 4, tokens, args.rounds, "forward")]
    if args.part in ("workloads", "all"):
        result["workloads"] = workloads(args.model, home, args.rounds, args.quick)
    if args.part in ("http", "all"):
        result["http"] = http(args.model, home, args.rounds, args.quick)
    if args.part in ("mtp", "all"):
        result["mtp"] = mtp("tiny-hybrid-mtp", home, 48 if args.quick else 128, args.rounds)
    emit(result, args.out)
    print(summary(result), file=sys.stderr)
    if args.plot and result.get("controlled"):
        plot(result, args.plot)


if __name__ == "__main__":
    main()
