"""Continuous batching: rows that join a running ``DecodeSession`` and retire from it.

A row's output depends on its own prompt alone: greedy rows equal the target's greedy decoding
whenever they joined and whoever shared their rounds, for every drafter kind (chains and
trees); a sampled row that joins mid-run follows the target's law (chi-square).
"""

from __future__ import annotations

import pytest
import torch
from decode_helpers import (
    ScriptedWidths,
    chi_square_p_value,
    exact_two_token_law,
    hf_greedy,
    noisy_copy,
    tiny_dflash_drafter,
    tiny_eagle_drafter,
    tiny_medusa_drafter,
    tiny_peagle_drafter,
)
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.drafters.base import Drafter, TreeSpec
from draftsmith.decode.drafters.hybrid import HybridDrafter
from draftsmith.decode.drafters.ngram import NgramDrafter
from draftsmith.decode.drafters.none import NoDrafter
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.session import DecodeSession, RoundUpdate
from tiny_models import tiny_llama

PROMPTS = [
    [5, 9, 12, 5, 9, 12, 5],  # repeats itself: prompt lookup drafts
    [3, 17, 40],
    [22, 8, 31, 14, 60, 27, 11, 9, 4, 30, 2, 19],
    [7],
    [44, 45, 46, 47, 44, 45],
]
LIMITS = [14, 6, 11, 17, 9]


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0)


def make_drafter(target: torch.nn.Module, kind: str) -> tuple[Drafter, TreeSpec | None]:
    vocab = target.config.vocab_size
    tree = TreeSpec(top_k=3, total_tokens=8)
    return {
        "none": lambda: (NoDrafter(vocab), None),
        "ngram": lambda: (NgramDrafter(vocab), None),
        "draft_lm": lambda: (DraftModelDrafter(noisy_copy(target, 0.3)), None),
        "eagle3": lambda: (tiny_eagle_drafter(target), None),
        "eagle3_tree": lambda: (tiny_eagle_drafter(target), tree),
        "medusa": lambda: (tiny_medusa_drafter(target), None),
        "medusa_tree": lambda: (tiny_medusa_drafter(target), TreeSpec()),
        "hybrid_draft_lm": lambda: (
            HybridDrafter(DraftModelDrafter(noisy_copy(target, 0.3))),
            None,
        ),
        "hybrid_eagle3": lambda: (HybridDrafter(tiny_eagle_drafter(target)), None),
        "peagle": lambda: (tiny_peagle_drafter(target), None),
        "eagle3_two_layers_tree": lambda: (tiny_eagle_drafter(target, num_layers=2), tree),
        "peagle_two_layers": lambda: (tiny_peagle_drafter(target, num_layers=2), None),
        "hybrid_peagle": lambda: (HybridDrafter(tiny_peagle_drafter(target)), None),
        "dflash": lambda: (tiny_dflash_drafter(target, markov_rank=3), None),
        "hybrid_dflash": lambda: (HybridDrafter(tiny_dflash_drafter(target)), None),
    }[kind]()


def greedy_reference(target: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_greedy(target, ids, max_new)
    return out[0, len(prompt) :].tolist()


class Collector:
    """The streamer: each request's tokens, by the session's row order."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # request id of each session row
        self.tokens: dict[int, list[int]] = {}
        self.updates: list[RoundUpdate] = []

    def __call__(self, update: RoundUpdate) -> None:
        self.updates.append(update)
        assert len(update.tokens) == len(self.rows)
        for row, tokens in enumerate(update.tokens):
            if update.accepted is not None and tokens:
                assert len(tokens) <= update.accepted[row] + 1 <= update.drafted + 1
            self.tokens.setdefault(self.rows[row], []).extend(tokens)

    def join(self, session: DecodeSession, requests: list[int]) -> None:
        """Add ``requests`` as new rows (one left-padded batch)."""
        width = max(len(PROMPTS[r]) for r in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(requests):
            ids[row, width - len(PROMPTS[request]) :] = torch.tensor(PROMPTS[request])
            mask[row, width - len(PROMPTS[request]) :] = 1
        self.rows += requests
        session.add_rows(ids, mask, [LIMITS[r] for r in requests])

    def retire_finished(self, session: DecodeSession) -> None:
        done = session.finished_rows()
        session.retire(done)
        self.rows = [r for row, r in enumerate(self.rows) if row not in set(done)]


@pytest.mark.parametrize(
    "kind",
    ["none", "ngram", "draft_lm", "eagle3", "eagle3_tree", "medusa", "medusa_tree",
     "hybrid_draft_lm", "hybrid_eagle3", "peagle", "hybrid_peagle", "eagle3_two_layers_tree",
     "peagle_two_layers", "dflash", "hybrid_dflash"],
)  # fmt: skip
def test_rows_joining_and_retiring_mid_run_keep_the_targets_greedy_output(
    target: torch.nn.Module, kind: str
) -> None:
    drafter, tree = make_drafter(target, kind)
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3, tree=tree)
    collector = Collector()
    session = decoder.session(eos_token_id=[], streamer=collector)
    collector.join(session, [0])
    session.step()
    session.step()
    collector.join(session, [1, 2])  # two prompts of other lengths join the running row
    session.step()
    collector.retire_finished(session)
    collector.join(session, [3])
    rounds = 0
    while session.room() > 0:
        session.step()
        collector.retire_finished(session)
        rounds += 1
        if rounds == 2:
            collector.join(session, [4])
    assert session.batch_size == 0 and collector.rows == []
    for request, prompt in enumerate(PROMPTS):
        expected = greedy_reference(target, prompt, LIMITS[request])
        assert collector.tokens[request] == expected, (kind, request)


def run_joins_and_retires(session: DecodeSession, collector: Collector) -> None:
    """Requests 0-4 join and retire between rounds until every one is done."""
    collector.join(session, [0])
    session.step()
    session.step()
    collector.join(session, [1, 2])
    rounds = 0
    while session.room() > 0:
        session.step()
        collector.retire_finished(session)
        rounds += 1
        if rounds in (1, 4):
            collector.join(session, [3] if rounds == 1 else [4])


@pytest.mark.parametrize("forget_after_rounds", [None, 1, 3])
@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "hybrid_eagle3"])
def test_rows_that_join_and_leave_between_rounds_without_drafts_keep_the_greedy_output(
    target: torch.nn.Module, kind: str, forget_after_rounds: int | None
) -> None:
    """Entries the head has not read travel with their rows through ``merge`` and
    ``select_rows``; with ``forget_after_rounds`` the older ones are dropped. Either way each
    row's drafts are verified, so every request is still the target's greedy output."""
    drafter, _ = make_drafter(target, kind)
    drafter.forget_after_rounds = forget_after_rounds
    if kind.startswith("hybrid"):  # the hybrid passes the setting to its learned drafter
        assert drafter.learned.forget_after_rounds == forget_after_rounds
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3)
    collector = Collector()
    session = decoder.session(
        eos_token_id=[], streamer=collector, draft_length=ScriptedWidths([0, 0, 0, 2, 0, 3, 0])
    )
    run_joins_and_retires(session, collector)
    assert session.batch_size == 0
    for request, prompt in enumerate(PROMPTS):
        expected = greedy_reference(target, prompt, LIMITS[request])
        assert collector.tokens[request] == expected, (kind, request)


@pytest.mark.parametrize("forget_after_rounds", [None, 2])
def test_joins_and_retirements_run_no_head_pass_and_forgotten_rounds_are_dropped(
    target: torch.nn.Module, forget_after_rounds: int | None
) -> None:
    """Rounds without drafts leave their entries unread; rows joining or leaving do not make
    the head read them (only the joining rows' own prefill runs it), and with
    ``forget_after_rounds`` no more than that many rounds wait."""
    drafter, _ = make_drafter(target, "eagle3")
    drafter.forget_after_rounds = forget_after_rounds
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3)
    collector = Collector()
    session = decoder.session(eos_token_id=[], streamer=collector, draft_length=ScriptedWidths([0]))
    collector.join(session, [2, 3])
    passes: list[int] = []
    head = session.drafter
    original = head._committed_pass
    head._committed_pass = lambda fused, *rest: (
        passes.append(fused.shape[0]) or original(fused, *rest)
    )
    for _ in range(4):
        session.step()
    assert passes == [] and len(head._state.unread) == (forget_after_rounds or 4)
    collector.join(session, [0])  # the spawn's prefill: a pass over the joining row alone
    session.retire([0])
    assert passes == [1]
    unread = head._state.unread
    assert [block.tokens.shape[0] for block in unread] == [2] * len(unread)
    session.drafter.propose(1, SamplingConfig(), None)  # one pass reads what waited
    assert passes == [1, 2] and head._state.unread == []


@pytest.mark.parametrize("kind", ["eagle3", "hybrid_dflash"])
def test_joining_rows_first_tokens_are_streamed_before_the_drafters_prefill_and_the_merges(
    target: torch.nn.Module, kind: str
) -> None:
    """Time to first token: a joining row's first token is its prefill's pending token, so it
    is streamed (once) before the drafter's prefill and the merges into the running caches;
    every request is still the target's greedy output."""
    drafter, _ = make_drafter(target, kind)
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3)
    collector = Collector()
    session = decoder.session(eos_token_id=[], streamer=collector)
    collector.join(session, [0])
    session.step()
    streamed_by: dict[str, int] = {}  # a step of the join: updates streamed when it ran

    def spying_spawn(spawn=session.drafter.spawn) -> Drafter:
        spawned = spawn()
        prefill = spawned.prefill

        def spying_prefill(*args) -> None:
            streamed_by["drafter prefill"] = len(collector.updates)
            prefill(*args)

        spawned.prefill = spying_prefill
        return spawned

    def spying_merge(other, merge=session.target.merge) -> None:
        streamed_by["target merge"] = len(collector.updates)
        merge(other)

    session.drafter.spawn, session.target.merge = spying_spawn, spying_merge
    before = len(collector.updates)
    collector.join(session, [1, 2])
    assert streamed_by == {"drafter prefill": before + 1, "target merge": before + 1}
    assert len(collector.updates) == before + 1
    first = collector.updates[before]
    assert first.accepted is None and [len(tokens) for tokens in first.tokens] == [0, 1, 1]
    while session.room() > 0:
        session.step()
        collector.retire_finished(session)
    for request in (0, 1, 2):
        expected = greedy_reference(target, PROMPTS[request], LIMITS[request])
        assert collector.tokens[request] == expected, (kind, request)


def test_generate_is_one_session_and_its_rows_keep_their_limits(target: torch.nn.Module) -> None:
    """Per-row ``max_new_tokens`` in one ``add_rows``; ``sequences`` records every token."""
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(target, 0.3)), 4)
    session = decoder.session(eos_token_id=[], record=True)
    ids = torch.tensor([PROMPTS[1], PROMPTS[0][:3]])
    session.add_rows(ids, None, [4, 9])
    while session.room() > 0:
        session.step()
    sequences = session.sequences(ids.to(decoder.device))
    assert sequences[0, 3:7].tolist() == greedy_reference(target, PROMPTS[1], 4)
    assert sequences[1, 3:].tolist() == greedy_reference(target, PROMPTS[0][:3], 9)
    assert session.count.tolist() == [4, 9] and session.finished_rows() == [0, 1]
    with pytest.raises(ValueError, match="gives 1 limits for 2 prompt rows"):
        session.add_rows(ids, None, [4])
    with pytest.raises(ValueError, match=r"max_new_tokens must lie in \[1, 2\*\*62\]"):
        session.add_rows(ids, None, [4, 0])


@pytest.mark.parametrize(
    "kind",
    ["draft_lm", *(pytest.param(k, marks=pytest.mark.slow) for k in ("eagle3", "peagle"))],
)
def test_a_sampled_row_joining_mid_run_follows_the_targets_law(
    target: torch.nn.Module, kind: str
) -> None:
    """The second token of a row merged into a running batch (its first speculative round
    after the merge, with a draft whose q differs from p) is distributed as the target's."""
    sampling = SamplingConfig(temperature=1.0)
    drafter, _ = make_drafter(target, kind)
    decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3)
    joining = torch.tensor(PROMPTS[1])
    _, second_law = exact_two_token_law(target, joining, sampling)
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros_like(second_law)
    trials = 300
    for _ in range(trials):
        collector = Collector()
        session = decoder.session(sampling=sampling, eos_token_id=[], generator=generator,
                                  streamer=collector)  # fmt: skip
        collector.join(session, [2])
        session.step()
        collector.join(session, [1])
        while len(collector.tokens.get(1, [])) < 2:
            session.step()
        counts[collector.tokens[1][1]] += 1
    assert chi_square_p_value(counts, second_law) > 1e-3
