"""Index views straight from verify scores: the torch reference against a per-row definition, the Triton kernel
against the reference (CPU through TRITON_INTERPRET=1; CUDA when present)."""

from __future__ import annotations

import pytest
import torch

from s3r_hf.cache.index_view import SparseIndexViews
from s3r_hf.kernels import reference

view_select = pytest.importorskip("s3r_hf.kernels.view_select_triton", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNUSED = reference.UNUSED_POSITION


def defined_views(scores, segments, history, contexts, budgets, width):
    """The definition, one row at a time: the best `budget - |R|` history positions (higher score first, then lower
    position) and the recent window `R`, ascending, `UNUSED` after the budget."""
    layers, _, heads, _ = scores.shape
    out = torch.full((layers, len(segments), heads, width), UNUSED, dtype=torch.int32)
    for i, segment in enumerate(segments.tolist()):
        h, c, b = int(history[i]), int(contexts[i]), int(budgets[i])
        recent = min(c - h, b)
        for layer in range(layers):
            for head in range(heads):
                row = scores[layer, segment, head, :h].tolist()
                best = sorted(range(h), key=lambda p: (-row[p], p))[: b - recent]
                view = sorted(best) + list(range(c - recent, c))
                out[layer, i, head, : len(view)] = torch.tensor(view, dtype=torch.int32)
    return out


def score_rows(kind: str, shape, generator) -> torch.Tensor:
    if kind == "random":
        return torch.rand(shape, generator=generator)
    if kind == "ties":  # few distinct values: the threshold's ties decide the view
        return torch.randint(0, 4, shape, generator=generator).float() / 8
    if kind == "close":  # neighbours a few units in the last place apart: the search's last, narrowest steps
        values = torch.full(shape, 0.3)
        for _ in range(5):
            up = torch.rand(shape, generator=generator) < 0.5
            values = torch.where(up, torch.nextafter(values, torch.ones(())), values)
        return values
    if kind == "signed":  # negatives, zeros of both signs and infinities, which the float order must keep
        values = torch.randn(shape, generator=generator)
        values[..., ::7] = 0.0
        values[..., 3::11] = -0.0
        values[..., 5::13] = float("inf")
        values[..., 6::17] = float("-inf")
        return values
    raise ValueError(kind)


# (history, context, budget) per segment: a top part and a recent window; the window alone (top part empty); the
# whole context; no history; a history longer than one block of the kernel's passes.
SEGMENTS = [(40, 47, 20), (30, 36, 5), (25, 25, 25), (0, 9, 9), (2500, 2507, 300)]


@pytest.mark.parametrize("kind", ["random", "ties", "close", "signed"])
def test_reference_views_match_their_definition(kind):
    generator = torch.Generator().manual_seed(0)
    rows = SEGMENTS[:4]
    scores = score_rows(kind, (2, 5, 2, 48), generator)
    segments = torch.tensor([3, 0, 4, 1])  # a subset of the scored segments, out of order
    history, contexts, budgets = (torch.tensor([row[i] for row in rows]) for i in range(3))
    width = int(budgets.max()) + 3
    got = reference.select_index_views(scores, segments, history, contexts, budgets, width)
    expected = defined_views(scores, segments, history, contexts, budgets, width)
    assert torch.equal(got, expected)


# Rows in registers searched one key a step (the default, a bisection) or 2, 3 or 4 (the sweep's other settings),
# and rows longer than `ROW` read in blocks (radix passes).
LAUNCHES = [None, (4096, 1024, 4, 2), (4096, 1024, 4, 3), (4096, 1024, 4, 4), (1024, 256, 4, 1)]
LAUNCH_IDS = ["default-bisection", "two-keys-a-step", "three-keys-a-step", "four-keys-a-step", "long-rows-by-radix"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
@pytest.mark.parametrize("kind", ["random", "ties", "close", "signed"])
def test_triton_views_match_the_reference(kind, launch, monkeypatch):
    """Every launch setting's views equal the reference's."""
    if launch is not None:
        monkeypatch.setattr(view_select, "LAUNCH_OVERRIDE", launch)
    generator = torch.Generator().manual_seed(1)
    history, contexts, budgets = (torch.tensor([row[i] for row in SEGMENTS]) for i in range(3))
    layers, heads, length = 2, 2, 2512
    scores = score_rows(kind, (layers, len(SEGMENTS) + 2, heads, length), generator)
    segments = torch.tensor([1, 6, 0, 3, 4])
    width = int(budgets.max()) + 5
    args = (segments, history, contexts, budgets, width)
    expected = reference.select_index_views(scores, *args)
    got = view_select.select_index_views(scores.to(DEVICE), *(t.to(DEVICE) for t in args[:4]), width)
    assert torch.equal(got.cpu(), expected)


def test_triton_views_read_strided_scores():
    """Scores as a layer-major view of a larger buffer (the layers' recorded scores need not be one tensor)."""
    generator = torch.Generator().manual_seed(2)
    base = torch.rand(3, 4, 2, 64, generator=generator)
    scores = base[::2, 1:, :, :50]  # strides of the base, a shorter key axis
    args = (torch.tensor([2, 0]), torch.tensor([45, 30]), torch.tensor([50, 33]), torch.tensor([12, 8]), 16)
    expected = reference.select_index_views(scores, *args)
    got = view_select.select_index_views(scores.to(DEVICE), *(t.to(DEVICE) for t in args[:4]), 16)
    assert torch.equal(got.cpu(), expected)


def test_stored_views_equal_views_built_from_candidates():
    """`SparseIndexViews.store` of selected views leaves what `build` from top-K candidates leaves."""
    generator = torch.Generator().manual_seed(3)
    layers, heads = 3, 2
    scores = torch.rand(layers, 2, heads, 40, generator=generator)
    segments, slots = torch.tensor([1, 0]), torch.tensor([4, 2])
    history, contexts, budgets = torch.tensor([30, 35]), torch.tensor([38, 40]), torch.tensor([12, 20])
    built, stored = (SparseIndexViews(layers, heads, max_requests=6, device=torch.device("cpu")) for _ in range(2))
    picked = scores[:, segments]
    candidates = reference.select_topk_candidates(picked.flatten(0, 1), history.repeat(layers), 20)
    built.build(None, slots, candidates.view(layers, 2, heads, 20), history, contexts, budgets, width=20)
    stored.store(None, slots, reference.select_index_views(scores, segments, history, contexts, budgets, 20), budgets)
    assert torch.equal(built.lengths, stored.lengths)
    for slot, budget in zip(slots.tolist(), budgets.tolist()):
        assert torch.equal(built.positions[:, slot, :, :budget], stored.positions[:, slot, :, :budget])


def test_launch_settings_follow_the_scores_length():
    """Rows are held in registers up to 4K, 8K and 16K scores: three kernel variants whatever the contexts."""
    assert view_select._launch(48)[0] == view_select._launch(4096)[0] == 4096
    assert view_select._launch(4097)[0] == view_select._launch(8192)[0] == 8192
    assert view_select._launch(8193)[0] == view_select._launch(10**6)[0] == 16384


def test_a_refresh_releases_the_plans_scores(monkeypatch):
    """Every scored forward (a verify, or a prefill that scores its prompts) writes each layer's scores into one
    tensor, which the refresh hands to the kernel as it is (no stack). After its views are rebuilt, a plan drops its
    scores (the next forward's would sit beside them), but for a round whose plan also finishes prompts (a mixed
    step), which refreshes their views from it next."""
    from s3r_hf import S3RConfig, enable
    from s3r_hf.engine.view_updates import IndexViewUpdates
    from tests.conftest import left_padded_batch, tiny_model

    rebuild, select = IndexViewUpdates.rebuild, reference.select_index_views
    recorded, selected, after = [], [], []

    def recording(self, plan, *args, **kwargs):
        recorded.append(plan.scores)
        rebuild(self, plan, *args, **kwargs)
        after.append((kwargs.get("keep_scores", False), plan.scores is None))

    def selecting(scores, *args, **kwargs):
        selected.append(scores)
        return select(scores, *args, **kwargs)

    monkeypatch.setattr(IndexViewUpdates, "rebuild", recording)
    monkeypatch.setattr(reference, "select_index_views", selecting)
    model = enable(tiny_model("llama", seed=5))
    input_ids, attention_mask = left_padded_batch([9, 23, 15], seed=6)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=2, page_size=4)
    model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12, s3r_config=config)
    assert len(after) > 2 and len(selected) == len(recorded), (after, len(selected))
    assert all(scores.shape[0] == model.config.num_hidden_layers for scores in recorded)
    assert all(given is scores for given, scores in zip(selected, recorded))
    assert all(keep != released for keep, released in after), after


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_triton_views_match_the_reference_at_random_edges(launch, monkeypatch):
    """Random shapes, subsets and lengths, down to a context of one, no history, a budget of zero and a width past
    every budget; scores random, tied or all zero."""
    import random

    if launch is not None:
        monkeypatch.setattr(view_select, "LAUNCH_OVERRIDE", launch)
    rng = random.Random(0)
    for case in range(16):
        shape = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 2, 17, 300, 1100]))
        scored, length = shape[1], shape[3]
        kind = ("random", "ties", "close", "signed", "zero")[case % 5]
        generator = torch.Generator().manual_seed(case)
        scores = torch.zeros(shape) if kind == "zero" else score_rows(kind, shape, generator)
        segments = torch.tensor(rng.sample(range(scored), rng.randint(1, scored)))
        contexts = [rng.randint(1, length) for _ in segments]
        history = [rng.randint(0, c) for c in contexts]
        budgets = [rng.randint(0, c) for c in contexts]
        width = max(max(budgets), 1) + rng.randint(0, 3)
        args = (segments, torch.tensor(history), torch.tensor(contexts), torch.tensor(budgets), width)
        expected = reference.select_index_views(scores, *args)
        got = view_select.select_index_views(scores.to(DEVICE), *(t.to(DEVICE) for t in args[:4]), width)
        assert torch.equal(got.cpu(), expected), (case, history, contexts, budgets, width)
