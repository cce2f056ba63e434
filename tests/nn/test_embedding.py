"""DynamicEmbedding: bag combiners over padded, masked and offset-encoded ids."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from recis_async.nn import AdmitHook, DynamicEmbedding, EmbeddingOption, FilterHook


def value_init(t: torch.Tensor) -> None:
    """Row i of a batch of new rows gets values 1 + i: distinct, predictable rows."""
    t.copy_(torch.arange(1, t.shape[0] + 1, dtype=t.dtype).unsqueeze(1).expand_as(t))


def make(combiner: str = "sum", **kw) -> DynamicEmbedding:
    return DynamicEmbedding(EmbeddingOption(3, "user", combiner, initializer=value_init, **kw))


def rows(emb: DynamicEmbedding, ids: list[int]) -> torch.Tensor:
    was = emb.training
    emb.eval()
    try:
        return emb.table(torch.tensor(ids)).detach()
    finally:
        emb.train(was)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_padded_masked_and_offsets_agree(combiner: str) -> None:
    emb = make(combiner)
    emb(torch.tensor([10, 20, 30, 40]))  # create rows with distinct values
    padded = torch.tensor([[10, 20, -1], [-1, -1, -1], [30, 30, 40]])
    masked_ids = torch.tensor([[10, 20, 7], [9, 9, 9], [30, 30, 40]])
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    flat, offsets = torch.tensor([10, 20, 30, 30, 40]), torch.tensor([0, 2, 2])
    r = {i: rows(emb, [i])[0] for i in (10, 20, 30, 40)}
    bags = [r[10] + r[20], torch.zeros(3), 2 * r[30] + r[40]]
    if combiner == "mean":
        bags = [bags[0] / 2, bags[1], bags[2] / 3]
    want = torch.stack(bags)
    for out in (emb(padded), emb(masked_ids, mask=mask), emb(flat, offsets)):
        assert out.shape == (3, 3)
        torch.testing.assert_close(out, want)
    assert emb.table.ids_count() == 4  # the masked-out 7 and 9 were never looked up


def test_one_dimensional_ids_without_offsets_are_one_row_each() -> None:
    emb = make()
    out = emb(torch.tensor([5, 6, 5]))
    assert out.shape == (3, 3) and torch.equal(out[0], out[2])


def test_gradients_reach_rows_through_the_combiner() -> None:
    emb = make("mean")
    emb(torch.tensor([[1, 2, 2]])).sum().backward()
    grad = emb.table.weight.grad
    assert grad is not None
    slots, _ = emb.table.lookup_slots(torch.tensor([1, 2]))
    torch.testing.assert_close(grad[slots], torch.tensor([[1 / 3] * 3, [2 / 3] * 3]))
    assert float(grad.sum()) == pytest.approx(3.0)


def test_read_only_unknown_ids_count_as_zero_rows_in_the_mean() -> None:
    emb = make("mean")
    emb(torch.tensor([1]))
    one = rows(emb, [1])[0]
    out = emb(torch.tensor([[1, 99, -1]]), admit_hook=AdmitHook("ReadOnly"))
    torch.testing.assert_close(out[0], one / 2)
    assert emb.table.ids_count() == 1
    out = emb(torch.tensor([[98, 99]]), admit_hook=AdmitHook("ReadOnly"))
    assert torch.equal(out, torch.zeros(1, 3))


def test_training_a_model_end_to_end() -> None:
    torch.manual_seed(0)
    emb = DynamicEmbedding(
        EmbeddingOption(
            4,
            "item",
            "mean",
            filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 5}),
            initializer=functools.partial(nn.init.normal_, std=0.1),
        )
    )
    head = nn.Linear(4, 1)
    opt = torch.optim.Adam([*emb.parameters(), *head.parameters()], lr=0.05)
    emb.attach_optimizer(opt)
    ids = torch.randint(0, 50, (64, 5))
    labels = (ids[:, 0] % 2).float()  # learnable from the first id
    losses = []
    for _ in range(80):
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(head(emb(ids)).squeeze(1), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bad_inputs_name_the_field() -> None:
    emb = make()
    with pytest.raises(ValueError, match="offsets: expected offsets\\[0\\] == 0"):
        emb(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="offsets: expected non-decreasing"):
        emb(torch.tensor([1, 2]), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="offsets: expected non-decreasing values <= len"):
        emb(torch.tensor([1, 2]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="mask: expected a bool tensor of shape \\(1, 2\\)"):
        emb(torch.tensor([[1, 2]]), mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="ids: expected a 2-D padded tensor"):
        emb(torch.zeros(1, 1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="ids: expected an integer tensor"):
        emb(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="EmbeddingOption.combiner: expected one of sum, mean"):
        EmbeddingOption(3, "x", "max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EmbeddingOption.embedding_dim"):
        EmbeddingOption(0, "x")
    with pytest.raises(ValueError, match="EmbeddingOption.shared_name"):
        EmbeddingOption(3, "")
    with pytest.raises(ValueError, match="EmbeddingOption.filter_hook: expected a FilterHook"):
        EmbeddingOption(3, "x", filter_hook=AdmitHook("ReadOnly"))  # type: ignore[arg-type]
    # checked where they are given, not when a DynamicEmbedding builds its table
    with pytest.raises(ValueError, match=r"EmbeddingOption.dtype: expected a floating torch.dtype"):
        EmbeddingOption(3, "x", dtype=torch.int64)
    with pytest.raises(ValueError, match=r"EmbeddingOption.initializer: expected a callable"):
        EmbeddingOption(3, "x", initializer=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"EmbeddingOption.sparse: expected a bool, got 'yes'"):
        EmbeddingOption(3, "x", sparse="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"EmbeddingOption.policies: expected a PolicyRegistry"):
        EmbeddingOption(3, "x", policies={})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"ids: expected a dense tensor holding ids, got one on meta"
    ):
        emb(torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="unknown admit policy 'Nope'"):
        DynamicEmbedding(EmbeddingOption(3, "x", admit_hook=AdmitHook("Nope")))
