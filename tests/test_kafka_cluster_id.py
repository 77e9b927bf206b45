"""`scripts/kafka.sh` takes cluster ids from Kafka's own generator and replaces a saved one that begins with
"-": kafka-storage's argument parser reads such an id as an option and formatting fails ("--cluster-id:
expected one argument"); the script's earlier hand-rolled ids began with "-" once in 64 checkouts."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIB = (
    REPO / ".kafka" / "lib"
)  # resolved from Maven Central by `scripts/kafka.sh up`, which make test runs first


def _cluster_ids(kdir: Path, groups: list[str]) -> list[str]:
    # Only the script's cluster_id function, with the variables it reads, run as the script runs it.
    script = f"""
set -euo pipefail
ROOT={REPO} KDIR={kdir} LIB={LIB}
die() {{ echo "kafka.sh: $*" >&2; exit 1; }}
eval "$(sed -n '/^cluster_id() {{/,/^}}/p' {REPO / "scripts" / "kafka.sh"})"
for group in {" ".join(groups)}; do cluster_id "$group"; done
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.split()


def test_a_leading_dash_id_is_replaced_and_good_ids_are_kept(tmp_path: Path) -> None:
    # Fails, never skips, without the jars: a green run must mean the script's generator really ran.
    assert LIB.is_dir(), "Kafka's jars are not resolved: run `bash scripts/kafka.sh up` (make test does)"
    for folder in ("config", "logs"):
        (tmp_path / folder).mkdir()
    (tmp_path / "config" / "single.cluster-id").write_text("-KI4LyC7Tx-U_jEAcCgbpA\n")
    (tmp_path / "config" / "cluster.cluster-id").write_text("gDvVqnmCT-63UV-J0jyS2w\n")
    single, cluster, again, fresh = _cluster_ids(tmp_path, ["single", "cluster", "single", "fresh"])
    assert len(single) == 22 and not single.startswith("-")
    assert cluster == "gDvVqnmCT-63UV-J0jyS2w"
    assert again == single
    assert len(fresh) == 22 and fresh not in (single, cluster)
