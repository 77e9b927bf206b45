#!/usr/bin/env bash
# The replay's verifier cost model measured on one GPU: `das bench verifier` with Qwen2.5-7B's shape, bf16,
# random weights, batch 1-256 x 1-17 query tokens per sequence, a 1024-token KV cache per sequence.
# Writes $OUT/verifier_qwen2.5-7b.json (what `das bench replay --cost-model` reads) and $OUT/env.txt.
# Expected well under 5 minutes on one H200: 9 prefills (the largest 256 x 1024 tokens) and 54 points of
# 6 forwards each; the timeout stops it at 270 s whatever happens.
#
# Run from the repository root on a machine with torch and transformers (no project install needed: the
# module is loaded by its path, so numba, Kafka and RocksDB are not imported):
#   OUT=/some/folder bash scripts/verifier_gpu.sh
set -euo pipefail
: "${OUT:?set OUT to the folder the JSON goes to}"
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"
timeout 270 python - "$OUT/verifier_qwen2.5-7b.json" <<'PY'
import importlib.util
import json
import sys
import time

spec = importlib.util.spec_from_file_location("das_verifier", "workers/bench/verifier.py")
verifier = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verifier)
start = time.monotonic()
result = verifier.measure("qwen2.5-7b", context=1024, repeats=5, device="cuda", dtype="bfloat16")
result["wall_s"] = round(time.monotonic() - start, 1)
with open(sys.argv[1], "w") as out:
    json.dump(result, out, indent=2)
c = result["cost_model"]
print(
    f"c_base {c['c_base'] * 1e3:.3f} ms, c_seq {c['c_seq'] * 1e3:.4f} ms, c_tok {c['c_tok'] * 1e3:.4f} ms, "
    f"fit {result['fit']}, {result['wall_s']} s"
)
PY
