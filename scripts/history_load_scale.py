"""What a drafting vLLM server pays to load the node's history, at scale (issue 37, item 6).

    python scripts/history_load_scale.py --tokens 10000000 --servers 4 --out /tmp/das-scale

Writes synthetic rollouts (pipeline/synthetic.py) with at least `--tokens` response tokens into a RocksDB history
store, then, each in a fresh process, opens it as a drafting server does: a real `DasProposer` on the store as
its replica (`DAS_HISTORY_DIR`), timing `load_model` (the open) and the resident memory it adds:
- `eager` (`DAS_HISTORY_LOAD=eager`): every problem's tree at start;
- `lazy` (the default): the bookkeeping and the global tree at start, then the trees of the problems one of
  `--servers` servers gets under problem-keyed routing (every servers-th problem), each built as its first
  request would build it (`prefetch` of one problem at a time, timed: what a first request adds to its step).
Prints JSON: tokens, seconds, resident memory added (bytes and bytes per token) for each, and the peak resident
memory the open reached above the memory before it (`open_peak_rss_added_bytes`: the load's transient peak, read
from the kernel's high-water mark after resetting it). `--code DIR` loads with the DAS build in DIR (e.g. an
earlier commit's `git archive`) on the same store: before/after figures of a change to the load.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _reset_peak() -> bool:
    """Resets the kernel's resident high-water mark of this process (Linux); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


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


def load(store_dir: Path, servers: int, mode: str) -> dict[str, object]:
    import os

    os.environ.update(
        DAS_HISTORY_DIR=str(store_dir),
        DAS_SECONDARY_DIR=str(store_dir.parent / f".scale-secondary-{mode}"),
        DAS_HISTORY_LOAD=mode,
        DAS_WINDOW_EPOCHS="3",
    )
    from workers.generator.proposer import DasProposer

    proposer = DasProposer.standalone(
        k=8, max_model_len=32768
    )  # compiles its kernels before the clock starts
    index = proposer.index
    before = _rss_bytes()
    peak_known = _reset_peak()
    started = time.perf_counter()
    proposer.load_model()
    result: dict[str, object] = {"open_seconds": round(time.perf_counter() - started, 2)}
    opened = _rss_bytes()
    result["open_rss_added_bytes"] = opened - before
    if peak_known:
        result["open_peak_rss_added_bytes"] = _peak_rss_bytes() - before
    problems = index.problem_ids()
    if mode == "lazy":
        routed = [p for p in problems if int(p.rsplit("-", 1)[1]) % servers == 0]
        seconds = []
        for problem_id in routed:
            began = time.perf_counter()
            proposer.prefetch([problem_id])
            seconds.append(time.perf_counter() - began)
        loaded = _rss_bytes()
        built = sum(index.problem_stats(p)["tokens"] for p in routed)
        result.update(
            routed_problems=len(routed),
            routed_tree_tokens=built,
            routed_load_seconds=round(sum(seconds), 2),
            first_request_ms={
                "median": round(1000 * statistics.median(seconds), 1),
                "p99": round(1000 * statistics.quantiles(seconds, n=100)[98], 1),
                "max": round(1000 * max(seconds), 1),
                "tokens_per_problem": round(built / max(1, len(routed))),
            },
            routed_rss_added_bytes=loaded - opened,
            routed_bytes_per_token=round((loaded - opened) / max(1, built), 1),
        )
    tree_tokens = sum(index.problem_stats(p)["tokens"] for p in problems)
    global_tokens = index.global_tree_tokens
    result.update(
        problems=len(problems),
        tree_tokens=tree_tokens,
        global_tree_tokens=global_tokens,
        rss_added_bytes=_rss_bytes() - before,
        bytes_per_tree_token=round((_rss_bytes() - before) / max(1, tree_tokens + global_tokens), 1),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--code", type=Path, help="load with the DAS build in this folder (default: this one)"
    )
    parser.add_argument("--load", choices=["eager", "lazy"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
    store_dir = args.out / "history"
    if args.load:
        print(json.dumps(load(store_dir, args.servers, args.load)))
        return
    started = time.perf_counter()
    built = (
        build(store_dir, args.tokens, args.problems) if not store_dir.exists() else {"reused": str(store_dir)}
    )
    built["build_seconds"] = round(time.perf_counter() - started, 1)
    result = {"store": built, "servers": args.servers, "code": str(args.code or REPO)}
    for part in ("eager", "lazy"):
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
                *(["--code", str(args.code)] if args.code is not None else []),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        result[part] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
