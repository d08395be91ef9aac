"""The migration pages (docs/migration/): their links resolve and their TRL loss functions run.

The verl page's registered function runs against verl itself in
tests/integrations/test_verl_integration.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = [DOCS / "migration" / f"{name}.md" for name in ("trl", "verl", "openrlhf")]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", [*PAGES, DOCS / "objectives" / "drop-in.md"], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name}: {target}"


def _trl_batch() -> dict[str, object]:
    generator = torch.Generator().manual_seed(3)
    log_probs = (-2 * torch.rand(4, 6, generator=generator)).requires_grad_(True)
    old = log_probs.detach() + 0.2 * torch.randn(4, 6, generator=generator)
    mask = torch.arange(6) < torch.tensor([6, 3, 0, 5])[:, None]
    return {
        "log_probs": log_probs, "old_log_probs": old,
        "advantages": torch.randn(4, generator=generator)[:, None].expand(4, 6), "mask": mask,
        "sampling_log_probs": old + 0.1 * torch.randn(4, 6, generator=generator),
        "num_items_in_batch": 28, "num_processes": 1, "gradient_accumulation_steps": 2,
        "steps_per_generation": 2, "ref_log_probs": None, "importance_sampling_ratio": None,
        "entropy": None,
    }  # fmt: skip


def test_trl_loss_functions_run() -> None:
    blocks = [b for b in python_blocks(DOCS / "migration" / "trl.md") if "def loss_fn" in b]
    assert len(blocks) == 2
    for block in blocks:
        code = "\n".join(line for line in block.splitlines() if not line.startswith("trainer"))
        namespace: dict[str, object] = {}
        exec(compile(code, "trl.md", "exec"), namespace)
        batch = _trl_batch()
        tensors = [batch.pop(name) for name in ("log_probs", "old_log_probs", "advantages", "mask")]
        loss, metrics = namespace["loss_fn"](*tensors, **batch)  # type: ignore[operator]
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
        loss.backward()
        grad = tensors[0].grad  # type: ignore[union-attr]
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_trl_dpo_loss_function_runs() -> None:
    blocks = [b for b in python_blocks(DOCS / "migration" / "trl.md") if "def dpo_loss_fn" in b]
    assert len(blocks) == 1
    code = "\n".join(line for line in blocks[0].splitlines() if not line.startswith("trainer"))
    namespace: dict[str, object] = {}
    exec(compile(code, "trl.md", "exec"), namespace)
    generator = torch.Generator().manual_seed(4)
    chosen = (-torch.rand(3, 5, generator=generator)).requires_grad_(True)
    rejected = -torch.rand(3, 4, generator=generator)
    masks = torch.ones(3, 5, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)
    loss, metrics = namespace["dpo_loss_fn"](  # type: ignore[operator]
        chosen, rejected, *masks, ref_chosen_log_probs=torch.zeros(3),
        ref_rejected_log_probs=torch.zeros(3), chosen_log_sum_sq_probs=None,
        rejected_log_sum_sq_probs=None,
    )  # fmt: skip
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert chosen.grad is not None and chosen.grad.abs().sum() > 0
