"""`das bench replay --max-num-seqs`: the replay under several slot settings and admission orders, side by side.

Each (slot setting, order) pair is one `replay.run` on finite engines (`workers.bench.engines`); this module
runs them (in parallel processes if asked) and tabulates makespans, the share of the oracle order's gain each
order captures, and das against none and suffix-problem under each order.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

from workers.bench import replay
from workers.bench.engines import Engines


def slots_label(max_num_seqs: int | float | None) -> str:
    """How a setting is named in results: "unlimited", "32" slots per engine, or a share "1/4"."""
    if max_num_seqs is None:
        return "unlimited"
    if isinstance(max_num_seqs, float):
        return (
            f"1/{round(1 / max_num_seqs)}"
            if round(1 / max_num_seqs) * max_num_seqs == 1
            else str(max_num_seqs)
        )
    return str(max_num_seqs)


def _order_block(by_order: dict[str, dict]) -> dict:
    """Makespan of every (order, strategy) pair per cost model, the share of the oracle order's gain over
    fcfs each order captures, and how das compares with none and suffix-problem under each order."""
    first = next(iter(by_order.values()))
    makespans: dict = {}
    captured: dict = {}
    das_change: dict = {}
    for cost, block in first["cost_models"].items():
        table = {
            s: {
                o: run["cost_models"][cost]["strategies"][s]["projected_makespan_s"]
                for o, run in by_order.items()
            }
            for s in block["strategies"]
        }
        makespans[cost] = table
        if "fcfs" in by_order and "oracle" in by_order:
            captured[cost] = {
                s: {
                    o: round((row["fcfs"] - m) / (row["fcfs"] - row["oracle"]), 4)
                    if row["fcfs"] > row["oracle"]
                    else None
                    for o, m in row.items()
                    if o not in ("fcfs", "oracle")
                }
                for s, row in table.items()
            }
        if "das" in table:
            das_change[cost] = {
                o: {
                    base: round(table["das"][o] / table[base][o] - 1, 4)
                    for base in ("none", "suffix-problem")
                    if base in table
                }
                for o in by_order
            }
    return {
        "makespan_s": makespans,
        "oracle_order_gain_captured": captured,
        "das_change": das_change,
        "runs": {o: run["cost_models"] for o, run in by_order.items()},
    }


def _replay(path: str, spec: Engines | None, replay_args: dict, progress: Callable | None) -> dict:
    return replay.run(path, progress=progress, engines=spec, **replay_args)


def run_slots(
    path: str,
    settings: Sequence[int | float | None],
    orders: Sequence[str],
    fleet: Engines,
    replay_args: dict,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> dict:
    """`das bench replay --max-num-seqs ...`: the replay under each slot setting (None: unlimited, every
    request of an epoch at once, where order does not matter unless `fleet.kv_tokens` limits the KV cache)
    and each admission order, `jobs` replays at a time (separate processes; each replay is deterministic, so
    the result does not depend on it).

    replay_args: `replay.run`'s strategies, config, window and costs."""
    # Without a KV budget, unlimited slots are the plain replay; with one, every request may start, as KV allows.
    plain = fleet.kv_tokens is None
    runs = [
        (
            setting,
            order,
            None
            if setting is None and plain
            else Engines(
                1.0 if setting is None else setting,
                fleet.engines,
                order,
                fleet.router,
                fleet.seed,
                fleet.kv_tokens,
            ),
        )
        for setting in settings
        for order in ([None] if setting is None and plain else orders)
    ]
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_replay, path, spec, replay_args, None) for _, _, spec in runs]
            results = [f.result() for f in futures]
    else:
        results = [_replay(path, spec, replay_args, progress) for _, _, spec in runs]
    done = {(setting, order): result for (setting, order, _), result in zip(runs, results, strict=True)}
    out: dict = {}
    blocks: dict = {}
    for setting in settings:
        label = slots_label(setting)
        if setting is None and plain:
            result = done[(None, None)]
            blocks[label] = {
                "makespan_s": {
                    cost: {s: r["projected_makespan_s"] for s, r in block["strategies"].items()}
                    for cost, block in result["cost_models"].items()
                },
                "runs": result["cost_models"],
            }
        else:
            by_order = {order: done[(setting, order)] for order in orders}
            result = by_order[orders[0]]
            blocks[label] = _order_block(by_order)
        out.setdefault("trace", result["trace"])
        out.setdefault("records", result["records"])
        out.setdefault("config", result["config"])
    return {
        **out,
        "fleet": {
            "engines": fleet.engines,
            "router": fleet.router,
            "seed": fleet.seed,
            "kv_tokens": fleet.kv_tokens,
        },
        "orders": list(orders),
        "max_num_seqs": blocks,
    }


def slots_table(result: dict) -> str:
    """Per slot setting and cost model: makespan of each strategy under each order, the share of the oracle
    order's gain each order captures, and das against none and suffix-problem."""
    fleet = result["fleet"]
    kv = f", KV cache {fleet['kv_tokens']} tokens per engine" if fleet["kv_tokens"] is not None else ""
    lines = [f"engines {fleet['engines']}, router {fleet['router']}{kv}"]
    for label, block in result["max_num_seqs"].items():
        for cost, table in block["makespan_s"].items():
            lines.append(f"max-num-seqs {label}, cost model {cost}: projected makespan s")
            if "oracle_order_gain_captured" not in block:
                lines.extend(f"  {s:15s} {m:10.2f}" for s, m in table.items())
                continue
            orders = list(next(iter(table.values())))
            lines.append(f"  {'strategy':15s} " + " ".join(f"{o:>10s}" for o in orders))
            for s, row in table.items():
                lines.append(f"  {s:15s} " + " ".join(f"{row[o]:10.2f}" for o in orders))
            for s, row in block["oracle_order_gain_captured"].get(cost, {}).items():
                shares = ", ".join(f"{o} {v:+.2f}" if v is not None else f"{o} -" for o, v in row.items())
                lines.append(f"  oracle-order gain captured, {s}: {shares}")
            for o, row in block["das_change"].get(cost, {}).items():
                changes = ", ".join(f"vs {b} {v:+.1%}" for b, v in row.items())
                lines.append(f"  das under {o}: {changes}")
        lines.append("")
    return "\n".join(lines).rstrip()
