"""What one store lookup costs, by block size and by tails under one parent (in-process).

The store answers a prompt's lookup with one walk of its prefix tree
(``TieredStore.match``): the full chain by block id, then the longest tail and,
for an attention-only model, the deepest cut, under the last block found. Its
cost must not grow with the block size or with how many tails (other sessions'
branch points) share that parent. For comparison, the way the store found tails
before (hashing every length from ``block_size - 1`` down to 1 at each level, each
hash a sha256 over up to a block of tokens) is timed on the same prompts.

Each setting stores a chain of ``--blocks`` full blocks plus ``tails`` tails of
other sessions below the last one (each leaving the prompt within a few tokens),
then times ``match`` of a prompt that leaves the chain inside the block after it
(a dense cut) and of a hybrid prompt (tails with checkpoints only). Prints JSON.

    python -m bench.lookup --out bench/results/lookup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from serve_app.cache.hashing import block_id, chain
from serve_app.cache.hot import HotEntry
from serve_app.cache.match import MatchQuery
from serve_app.cache.tiers import TieredStore

ROOT = "r" * 64
BLOCK_SIZES = (16, 64, 256, 1024)
TAILS = (0, 100, 1000, 10000)


def prompt_of(n: int, seed: int = 7) -> list[int]:
    return [5 + (i * seed) % 30000 for i in range(n)]


def build(block_size: int, blocks: int, tails: int) -> tuple[TieredStore, list[int]]:
    """A store holding ``blocks`` full blocks of a prompt and ``tails`` tails below the last;
    the prompt returned leaves the stored chain inside the block after it."""
    prompt = prompt_of((blocks + 1) * block_size + 8)
    ids = chain(ROOT, prompt, block_size)
    store = TieredStore(1 << 40)
    for i in range(blocks + 1):  # block ``blocks`` is the one the query will be cut from
        own = prompt[i * block_size : (i + 1) * block_size]
        store.hot.put(HotEntry(ids[i], ids[i - 1] if i else ROOT, 1, True, handle=i,
                               token_ids=tuple(own)))
    start = blocks * block_size
    for t in range(tails):  # other sessions: share 1..8 tokens of the block, then differ
        own = prompt[start : start + 1 + t % 8] + [40000 + t, 50000 + t % 97]
        store.hot.put(HotEntry(block_id(ids[blocks - 1], own), ids[blocks - 1], 1, t % 2 == 0,
                               handle=t, token_ids=tuple(own)))
    # The query shares most of block ``blocks`` and then differs.
    keep = start + block_size * 3 // 4
    query = prompt[:keep] + [60000 + i for i in range(block_size)]
    store.release(store.match(query_of(query, block_size, False)).lease)  # syncs the tree
    return store, query


def query_of(prompt: list[int], block_size: int, hybrid: bool) -> MatchQuery:
    ids = chain(ROOT, prompt, block_size)[: (len(prompt) - 1) // block_size]
    return MatchQuery(ids, need_state=hybrid, root=ROOT, tokens=tuple(prompt[:-1]),
                      block_size=block_size)


def per_length_hashing(store: TieredStore, q: MatchQuery, levels: int) -> None:
    """The tail search as it was: every length hashed and looked up, at ``levels`` levels
    (a hybrid walkback repeats it per block given up)."""
    present = len(q.block_ids)
    for i in range(present, max(-1, present - levels), -1):
        start = i * q.block_size
        parent = q.block_ids[i - 1] if i else q.root
        for k in range(min(q.block_size - 1, len(q.tokens) - start), 0, -1):
            store.hot.entry(block_id(parent, list(q.tokens[start : start + k])))


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - tic)
    return statistics.median(samples)


def measure(block_size: int, tails: int, blocks: int, repeats: int) -> dict:
    store, prompt = build(block_size, blocks, tails)
    out: dict = {"block_size": block_size, "tails": tails, "blocks": blocks}
    for hybrid in (False, True):
        q = query_of(prompt, block_size, hybrid)
        found = store.match(q)
        store.release(found.lease)
        label = "hybrid" if hybrid else "dense"
        out[f"{label}_restored_tokens"] = sum(found.block_tokens(block_size))

        def match(q: MatchQuery = q) -> None:
            store.release(store.match(q).lease)

        out[f"{label}_match_us"] = round(timed(match, repeats) * 1e6, 1)
    q = query_of(prompt, block_size, False)
    out["per_length_hashing_us"] = round(
        timed(lambda: per_length_hashing(store, q, 1), max(3, repeats // 10)) * 1e6, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="store", help="ignored: no model is loaded")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--blocks", type=int, default=32, help="full blocks in the chain")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="fewer settings and repeats")
    args = parser.parse_args(argv)
    sizes = BLOCK_SIZES[:3] if args.quick else BLOCK_SIZES
    tails = TAILS[:3] if args.quick else TAILS
    repeats = 30 if args.quick else args.repeats
    rows = [measure(bs, t, args.blocks, repeats) for bs in sizes for t in tails]
    base = next(r for r in rows if r["block_size"] == sizes[0] and r["tails"] == 0)
    worst = max(rows, key=lambda r: r["dense_match_us"])
    result = {
        "bench": "lookup", "rows": rows,
        # The goal: a lookup's cost flat in block size and in tails under a parent.
        "dense_match_us_max_over_min": round(worst["dense_match_us"] / base["dense_match_us"],
                                             2),
        "largest": {k: worst[k] for k in ("block_size", "tails", "dense_match_us")},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
