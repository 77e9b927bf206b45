"""`scripts/kafka.sh` never hands kafka-storage a cluster id that begins with "-": its argument parser reads
one as an option and formatting fails ("--cluster-id: expected one argument"), one fresh checkout in 64."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cluster_ids(kdir: Path, groups: list[str]) -> list[str]:
    # Only the script's cluster_id function, run as the script runs it.
    script = f"""
set -euo pipefail
PY=python3 KDIR={kdir}
eval "$(sed -n '/^cluster_id() {{/,/^}}/p' {REPO / "scripts" / "kafka.sh"})"
for group in {" ".join(groups)}; do cluster_id "$group"; done
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()


def test_a_leading_dash_id_is_replaced_and_good_ids_are_kept(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "single.cluster-id").write_text("-KI4LyC7Tx-U_jEAcCgbpA\n")
    (tmp_path / "config" / "cluster.cluster-id").write_text("gDvVqnmCT-63UV-J0jyS2w\n")
    single, cluster, again = _cluster_ids(tmp_path, ["single", "cluster", "single"])
    assert not single.startswith("-") and len(single) == 22
    assert cluster == "gDvVqnmCT-63UV-J0jyS2w"
    assert again == single


def test_fresh_ids_never_begin_with_a_dash(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    ids = _cluster_ids(tmp_path, [f"g{i}" for i in range(100)])
    assert len(set(ids)) == 100
    assert not any(i.startswith("-") for i in ids)
