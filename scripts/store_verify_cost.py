"""Cost of the background verification: verify time per store size, and apply throughput with a verifier
reading the same store continuously against none."""

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from history_store.durable.store import HistoryStore, verify_store
from pipeline.synthetic import SyntheticShape, synthetic_records

n = int(sys.argv[1])
shape = SyntheticShape()  # defaults: 64 problems, 3 epochs, prompts ~200 tokens, responses ~1000 (log-normal)
records = list(synthetic_records(0, n, shape))
out = {"records": n}
with tempfile.TemporaryDirectory() as tmp:

    def ingest(path, verify):
        stop = threading.Event()
        rounds = [0]

        def loop():
            while not stop.is_set():
                verify_store(path)
                rounds[0] += 1

        with HistoryStore(path, window_epochs=3) as store:
            store.apply(records[:500])
            t = threading.Thread(target=loop) if verify else None
            if t:
                t.start()
            started = time.perf_counter()
            for i in range(500, n, 500):
                store.apply(records[i : i + 500])
            seconds = time.perf_counter() - started
            stop.set()
            if t:
                t.join()
        return (n - 500) / seconds, rounds[0]

    base, _ = ingest(Path(tmp) / "a", False)
    loaded, rounds = ingest(Path(tmp) / "b", True)
    with HistoryStore(Path(tmp) / "b") as s:
        s.compact()
        size = s.stats().disk_bytes
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        r = verify_store(Path(tmp) / "b")
        times.append(time.perf_counter() - t0)
        assert r.ok
    out.update(
        store_bytes=size,
        verify_s=round(min(times), 3),
        verify_mb_per_s=round(size / 1e6 / min(times), 1),
        apply_records_per_s_alone=round(base),
        apply_records_per_s_with_verifier_looping=round(loaded),
        verifications_during_ingest=rounds,
    )
print(json.dumps(out))
