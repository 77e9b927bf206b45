"""What a drafting vLLM server pays to load the node's history at start, at scale (issue 37, item 6).

    python scripts/history_load_scale.py --tokens 10000000 --servers 4 --out /tmp/das-scale

Writes synthetic rollouts (pipeline/synthetic.py) with at least `--tokens` response tokens into a RocksDB history
store, then, each in a fresh process, loads into a ProblemIndex what a server loads:
- `all`: every problem (what the proposer does today with DAS_HISTORY_DIR);
- `routed`: the problems one of `--servers` servers gets under problem-keyed routing (every servers-th problem),
  loaded from the same store: the cost a server would pay if it loaded only its routed problems.
Prints JSON: tokens, load seconds, resident memory added (bytes and bytes per loaded token) for each.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def build(out: Path, tokens: int, problems: int) -> dict[str, int]:
    from history_store.durable.store import HistoryStore
    from pipeline.synthetic import SyntheticShape, synthetic_record

    shape = SyntheticShape(problems=problems, epochs=3)
    count = 0
    written = 0
    with HistoryStore(out) as store:
        while written < tokens:
            batch = [synthetic_record(0, count + i, 10**6, shape) for i in range(500)]
            store.apply(batch, {})
            written += sum(len(r.response_ids) for r in batch)
            count += len(batch)
    return {"records": count, "response_tokens": written, "problems": problems}


def load(store_dir: Path, servers: int, part: str) -> dict[str, float]:
    from history_store.automaton.problem_index import ProblemIndex
    from history_store.durable.store import HistoryStore

    index = ProblemIndex(window_epochs=3)
    before = _rss_bytes()
    started = time.perf_counter()
    with HistoryStore.open_secondary(store_dir, store_dir.parent / f".scale-secondary-{part}") as reader:
        keys = [t.key for t in reader.iter_trajectories()]
        if part == "routed":
            keys = [k for k in keys if int(k[0].rsplit("-", 1)[1]) % servers == 0]
        records = [r for r in (reader.get(*k) for k in keys) if r is not None]
        index.add_trajectories(
            (r.problem_id, r.epoch, r.sample, r.prompt_ids, r.response_ids) for r in records
        )
        tokens = sum(r.response_ids.size + r.prompt_ids.size for r in records)
        del records
    seconds = time.perf_counter() - started
    added = _rss_bytes() - before
    return {
        "problems": len(index.problem_ids()),
        "tokens_loaded": int(tokens),
        "seconds": round(seconds, 2),
        "rss_added_bytes": added,
        "bytes_per_token": round(added / max(1, tokens), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load", choices=["all", "routed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    store_dir = args.out / "history"
    if args.load:
        print(json.dumps(load(store_dir, args.servers, args.load)))
        return
    started = time.perf_counter()
    built = (
        build(store_dir, args.tokens, args.problems) if not store_dir.exists() else {"reused": str(store_dir)}
    )
    built["build_seconds"] = round(time.perf_counter() - started, 1)
    result = {"store": built, "servers": args.servers}
    for part in ("all", "routed"):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--out",
                str(args.out),
                "--servers",
                str(args.servers),
                "--load",
                part,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        result[part] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
