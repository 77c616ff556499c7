"""The speculative decoder: propose -> verify -> accept -> roll back, round after round.

One round (docs/theory.md §1-3): the drafter guesses N tokens after each row's pending
token; the target scores ``[pending, d_1 .. d_N]`` in **one** forward pass over its KV cache;
verification keeps the accepted prefix and emits one recovered or bonus token; both caches drop
what was rejected (no re-prefill). Each round emits between 1 and N + 1 tokens per row, and
the output is distributed exactly as the target's (greedy: equal to its greedy output).
Rounds run in a ``DecodeSession``, whose rows may join (``add_rows``) and leave (``retire``)
between rounds (continuous batching, as the server runs it); ``generate`` is one session.

"The target's" means its forward on the cache (``CachedSequence``) with each call's positions.
Two rope types make a forward depend on how tokens are grouped into calls, in Hugging Face's
own forward too: dynamic NTK past ``max_position_embeddings`` and longrope in a call that
crosses ``original_max_position_embeddings`` (both switch frequencies by the call's largest
position). There a verification pass of N + 1 tokens and a one-token step may disagree; below
those thresholds (and for longrope wholly above it) every rope type is exact. The switch is the
call's, so it is shared by the rows of a batch: a row below the threshold decoded beside a row
above it (in one ``generate`` or a session's rows) gets the long factors, as in Hugging Face's
batched ``generate``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from types import EllipsisType

import torch
from draftsmith.decode.defaults import NUM_DRAFT_TOKENS
from draftsmith.decode.draft_length import (
    AdaptiveDraftLength,
    LoadAwareDraftLength,
    SessionDraftLength,
)
from draftsmith.decode.drafters.base import Drafter, TargetPass, TreeSpec, require_left_padded
from draftsmith.decode.forward.attention_layout import (
    learned_position_limit,
    single_row_problem,
    tree_verification_problem,
)
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.forward.lean_decoder import LeanDecoder
from draftsmith.decode.forward.output_head import OutputHead
from draftsmith.decode.rejection import verify_chain
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs, select_tokens
from draftsmith.decode.stats import DecodeStats


@dataclass(frozen=True)
class RoundUpdate:
    """What one round (or one prefill) emitted, per row of the session's batch.

    ``tokens[b]`` are row ``b``'s new tokens (empty for a row that took no part: finished, or
    not among a prefill's new rows); ``accepted[b]`` the drafts row ``b`` accepted in this
    verification pass and ``drafted`` the drafts per row it verified (chain length or tree
    depth). A prefill emits each new row's first token with ``accepted = None``, ``drafted = 0``.
    """

    tokens: list[list[int]]
    accepted: list[int] | None
    drafted: int


# Called after every prefill and round; returning False stops ``generate`` early.
Streamer = Callable[[RoundUpdate], "bool | None"]


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, prompt_len + new], finished rows padded
    stats: DecodeStats


class SpeculativeDecoder:
    """Runs a target causal LM with a drafter; see ``generate``."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: Drafter,
        num_draft_tokens: int = NUM_DRAFT_TOKENS,
        tree: TreeSpec | None = None,
        lean_target: bool = True,
        adaptive: bool = False,
    ) -> None:
        """``tree`` switches to tree drafting (depth ``num_draft_tokens``) for drafters that
        support it (EAGLE-3, Medusa); ``None`` drafts chains. ``lean_target`` runs a
        Llama-family target on CPU through ``LeanDecoder`` (the same weights and mathematics
        with fused products: logits equal the model's own forward to float rounding); False
        keeps the model's own forward. ``adaptive`` picks each chain round's draft length in
        ``0 .. num_draft_tokens`` from the measured acceptance and round times
        (``AdaptiveDraftLength``; 0 is a plain target step), ``num_draft_tokens`` then a bound
        that a drafter with fewer positions (Medusa's heads) lowers to its own; with ``tree``
        it picks each round's shape, a plain step, a chain or a tree (``draftsmith.decode.trees.policy``).
        Its estimates carry over from one ``generate`` call to the next."""
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise TypeError(f"num_draft_tokens must be an int, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ValueError(
                f"num_draft_tokens must be >= 1 (drafted tokens per round), got {num_draft_tokens}"
            )
        drafter.check_compatible(target)
        problem = None if tree is None else tree_verification_problem(target)
        if problem is not None:
            raise ValueError(problem)
        if tree is not None and not drafter.supports_trees:
            raise ValueError(
                f"the {drafter.kind} drafter drafts chains only: drop the tree settings or use "
                "an eagle3 or medusa drafter"
            )
        most = drafter.max_draft_tokens
        if tree is None and not adaptive and most is not None and num_draft_tokens > most:
            raise ValueError(
                f"the {drafter.kind} drafter drafts at most {most} tokens per chain, got "
                f"num_draft_tokens={num_draft_tokens}: pass num_draft_tokens <= {most} or a tree"
            )
        self.tree = tree
        self.target = target.eval()
        self.position_table = learned_position_limit(target)  # None: no learned table
        self._target_head = OutputHead.for_model(self.target)
        self._target_decoder = (
            LeanDecoder.for_model(self.target)
            if lean_target and self._target_head is not None
            else None
        )
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        # An adaptive length is a bound, not a demand: at most what the drafter can draft.
        longest = num_draft_tokens if most is None else min(num_draft_tokens, most)
        self.draft_length = AdaptiveDraftLength(longest) if adaptive else None
        # Adaptive trees: the policy picks each round's shape in _tree_round and takes the
        # draft-length hook's place, so the chain rounds it delegates report to it.
        self.tree_policy = None
        if adaptive and tree is not None:
            from draftsmith.decode.trees.policy import TreeSizePolicy

            vary = tree.choices is None and drafter.kind == "eagle3"  # EAGLE-2 dynamic trees
            # Its chain rounds draft up to the menu's depth: no deeper than the drafter's chains.
            self.tree_policy = TreeSizePolicy(tree, longest, vary_top_k=vary)
            self.draft_length = self.tree_policy

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,  # [B, T] left-padded
        attention_mask: torch.Tensor | None = None,  # [B, T]
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        pad_token_id: int | None = None,
        streamer: Streamer | None = None,
        *,
        sampling: SamplingConfig | None = None,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` tokens per row.

        ``eos_token_id=None`` uses the target's generation config (pass ``[]`` for none); a row
        stops after its first EOS. Sampling applies temperature, then top-k, then top-p to the
        target and the draft alike; greedy below ``GREEDY_TEMPERATURE_FLOOR`` (0 included).
        Give either ``sampling`` (one validated ``SamplingConfig``) or the separate
        ``temperature`` / ``top_k`` / ``top_p`` (unset ones take ``SamplingConfig``'s defaults).
        ``generator`` must live on the target's device. Bad arguments raise ``ValueError``
        (wrong values) or ``TypeError`` (wrong types) before any forward pass. One
        ``DecodeSession`` with every row, stepped until each row is done.
        """
        sampling = _sampling_config(sampling, temperature, top_k, top_p)
        session = self.session(
            sampling=sampling,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            generator=generator,
            streamer=streamer,
            drafter=self.drafter,
            record=True,
        )
        input_ids, _ = self._check_inputs(input_ids, attention_mask, max_new_tokens)
        start = _clock(self.device)
        session.add_rows(input_ids, attention_mask, max_new_tokens)
        while session.room() > 0:
            session.step()
        stats = session.stats
        stats.total_seconds = _clock(self.device) - start
        stats.tokens_emitted = int(session.count.sum())
        return GenerateOutput(sequences=session.sequences(input_ids), stats=stats.fold())

    def session(
        self,
        *,
        sampling: SamplingConfig | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        streamer: Streamer | None = None,
        drafter: Drafter | None = None,
        record: bool = False,
        tree: TreeSpec | EllipsisType | None = ...,
        draft_length: AdaptiveDraftLength | LoadAwareDraftLength | EllipsisType | None = ...,
    ) -> DecodeSession:
        """An empty ``DecodeSession``: rows join with ``add_rows``, leave with ``retire``.

        Its rows share the sampling settings and the generator. ``drafter`` holds the
        session's drafting state: by default a ``spawn`` of this decoder's drafter (the same
        weights), so several sessions can be open at once; ``record`` keeps every emitted token
        for ``sequences``; ``tree`` replaces the decoder's tree settings (``None``: chains);
        ``draft_length`` replaces the decoder's chain-length policy (``None``: fixed N; a
        ``LoadAwareDraftLength`` shared by sessions chooses by batch size and each row's
        acceptance, as the server does).
        """
        sampling = _sampling_config(sampling, None, None, None)
        tree = self.tree if tree is ... else tree
        if tree is not None and not self.drafter.supports_trees:
            raise ValueError(
                f"the {self.drafter.kind} drafter drafts chains only: drop the tree settings"
            )
        policy = self.draft_length if draft_length is ... else draft_length
        if tree is not None and policy is not None and policy is not self.tree_policy:
            raise ValueError(
                "this decoder adapts chain lengths: build it with the tree to adapt trees"
            )
        if generator is not None:
            self._check_generator(generator)
        eos = self._eos_tensor(eos_token_id)
        pad = self._pad_id(pad_token_id, eos)
        drafter = self.drafter.spawn() if drafter is None else drafter
        return DecodeSession(
            self, drafter, sampling, generator, eos, pad, streamer, record, tree, policy
        )

    def _chain_round(self, session: DecodeSession, width: int) -> torch.Tensor:  # [B]
        """Draft a chain, verify it in one target pass, roll both caches back, emit; returns
        the new pending tokens."""
        drafter, target, sampling = session.drafter, session.target, session.sampling
        needs_hidden = drafter.needs_hidden_states
        round_start = _clock(self.device)
        proposal = drafter.propose(width, sampling, session.generator)
        drafts = proposal.tokens  # [B, n]
        verify_start = _clock(self.device)
        verify = target.extend(
            torch.cat([session.pending[:, None], drafts], dim=1), output_hidden_states=needs_hidden
        )
        num_accepted, pending = verify_chain(
            drafts, proposal.probs, verify.logits, sampling, session.generator
        )
        target.rollback(drafts.shape[1] + 1, num_accepted + 1)
        verify_end = _clock(self.device)
        drafter.commit(num_accepted, pending, TargetPass(verify.logits, verify.hidden_states))
        policy = session.draft_length
        accepted_by_active_rows = num_accepted[session.active] if policy is not None else None
        session.finish_round(drafts, num_accepted, pending)
        round_end = _clock(self.device)
        session.add_times(round_start, verify_start, verify_end, round_end)
        if policy is not None:  # read before finish_round retires rows that just ended
            # A lookup round may copy more tokens than the policy's width (HybridDrafter):
            # the policy hears of the width it chose, or of fewer drafts when fewer came.
            drafted = min(drafts.shape[1], width)
            policy.update(drafted, accepted_by_active_rows, round_end - round_start)
        return pending

    def _tree_round(self, session: DecodeSession, width: int) -> torch.Tensor:  # [B]
        """Draft a tree, score all its nodes in one pass with a tree mask, keep one branch.

        At T > 0 a drafter with ``supports_sampled_trees`` draws its nodes from its own q
        (multi-draft speculative sampling, docs/theory.md §4); top-k trees serve T = 0 and
        drafters without sampled trees. Returns the new pending tokens.
        """
        from draftsmith.decode.trees.verify import verify_tree_greedy, verify_tree_stochastic

        drafter, target, sampling = session.drafter, session.target, session.sampling
        generator = session.generator
        sampled = not sampling.greedy and drafter.supports_sampled_trees
        policy, spec = self.tree_policy, session.tree
        if policy is not None:  # adaptive: this round's shape (a chain reports itself)
            shape = policy.choose_shape(width, greedy=sampling.greedy, sampled=sampled)
            if shape.kind == "chain":
                return self._chain_round(session, shape.depth)
            spec, width = shape.tree_spec(session.tree), shape.depth
            active = session.active.clone()  # finish_round retires rows that just ended
        round_start = _clock(self.device)
        if sampled:
            tree = drafter.propose_sampled_tree(spec, width, sampling, generator)
        else:
            tree = drafter.propose_tree(spec, width)
        verify_start = _clock(self.device)
        verify = target.extend(
            tree.input_ids(session.pending),
            tree_mask=tree.attention_mask(),
            positions=tree.positions(target.lengths),
            output_hidden_states=drafter.needs_hidden_states,
        )
        if sampling.greedy:
            outcome = verify_tree_greedy(tree, verify.logits)
        else:
            probs = logits_to_probs(verify.logits, sampling)
            outcome = verify_tree_stochastic(tree, probs, generator)
        path = outcome.path_indices()  # [B, D + 1]: root, then the accepted nodes
        kept = (
            torch.arange(path.shape[1], device=path.device)[None, :]
            <= outcome.num_accepted[:, None]
        )
        target.keep_path(tree.num_nodes + 1, path, kept)
        verify_end = _clock(self.device)
        drafter.commit_tree(outcome, TargetPass(verify.logits, verify.hidden_states))
        session.finish_round(outcome.accepted_tokens, outcome.num_accepted, outcome.next_tokens)
        round_end = _clock(self.device)
        session.add_times(round_start, verify_start, verify_end, round_end)
        if policy is not None:
            nodes = outcome.accepted_nodes[active]
            policy.update_tree(shape, nodes, tree.num_nodes, round_end - round_start)
        return outcome.next_tokens

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_len]")
        if (
            input_ids.dtype.is_floating_point
            or input_ids.dtype.is_complex
            or (input_ids.dtype == torch.bool)
        ):
            raise TypeError(
                f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}"
            )
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(
                f"empty prompt batch (input_ids has shape {tuple(input_ids.shape)}): give every "
                "row at least one token"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        _check_limit(max_new_tokens)
        input_ids = input_ids.to(self.device, torch.long)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
        attention_mask = attention_mask.to(self.device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}"
            )
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real tokens)")
        if bool((attention_mask.sum(-1) == 0).any()):
            raise ValueError("a prompt row is empty (its attention_mask is all zero)")
        require_left_padded(attention_mask)
        vocab = self.drafter.vocab_size
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise ValueError(f"input_ids hold token ids outside [0, {vocab})")
        return input_ids, attention_mask

    def _check_generator(self, generator: object) -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator (or None), got {type(generator).__name__}"
            )
        if not _same_device(generator.device, self.device):
            raise ValueError(
                f"generator lives on {generator.device} but the target on {self.device}: "
                f"create it with torch.Generator(device={str(self.device)!r})"
            )

    def _eos_tensor(self, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:  # [E]
        source = "eos_token_id"
        if eos_token_id is None:
            eos_token_id = getattr(self.target.generation_config, "eos_token_id", None)
            source = "the target's generation_config.eos_token_id (pass eos_token_id to override)"
        if eos_token_id is None:
            eos_token_id = []
        if _is_token_id(eos_token_id):
            eos_token_id = [eos_token_id]
        if isinstance(eos_token_id, (str, bytes, torch.Tensor)) or not isinstance(
            eos_token_id, Sequence
        ):
            raise TypeError(
                f"{source} must be a token id or a list of token ids, got {eos_token_id!r}"
            )
        for token in eos_token_id:
            self._check_token_id(token, source)
        return torch.tensor([int(t) for t in eos_token_id], dtype=torch.long, device=self.device)

    def _pad_id(self, pad_token_id: int | None, eos: torch.Tensor) -> int:
        if pad_token_id is not None:
            self._check_token_id(pad_token_id, "pad_token_id")
            return int(pad_token_id)
        configured = getattr(self.target.generation_config, "pad_token_id", None)
        if configured is not None:
            self._check_token_id(
                configured,
                "the target's generation_config.pad_token_id (pass pad_token_id to override)",
            )
            return int(configured)
        return int(eos[0]) if eos.numel() else 0

    def _check_token_id(self, token: object, source: str) -> None:
        """A token id is an int in [0, V) (``TypeError`` for other types, else ``ValueError``)."""
        if not _is_token_id(token):
            raise TypeError(f"{source} must hold integer token ids, got {token!r}")
        vocab = self.drafter.vocab_size
        if not 0 <= int(token) < vocab:
            raise ValueError(
                f"{source} holds token id {int(token)}, outside the vocabulary [0, {vocab})"
            )


def _sampling_config(
    sampling: SamplingConfig | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
) -> SamplingConfig:
    """The one ``SamplingConfig`` of a call: the one given, or one built from the keywords."""
    separate = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    given = {name: value for name, value in separate.items() if value is not None}
    if sampling is None:
        return SamplingConfig(**given)
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if given:
        raise ValueError(
            f"pass either sampling or {', '.join(given)}, not both: put every setting into the "
            "SamplingConfig"
        )
    return sampling


def _is_token_id(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, an index-less CUDA device meaning the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


class DecodeSession:
    """Rows that decode together round by round, joining and leaving between rounds.

    Continuous batching: ``add_rows`` prefills new prompts as a batch of their own (the target
    and a ``spawn`` of the drafter) and merges them into the running caches
    (``CachedSequence.merge``, ``Drafter.merge``); ``step`` runs one round for every row;
    ``retire`` drops rows (``select_rows``), freeing their cache slots. Each row's tokens
    depend on its own prompt alone: greedy rows equal the target's greedy decoding whenever
    they joined. Rows share the sampling settings and the generator (sampled rows of a seeded
    request are reproducible only alone in their session). ``generate`` is one session.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        drafter: Drafter,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        eos: torch.Tensor,  # [E]
        pad: int,
        streamer: Streamer | None,
        record: bool,
        tree: TreeSpec | None,
        draft_length: AdaptiveDraftLength | LoadAwareDraftLength | None = None,
    ) -> None:
        device = decoder.device
        self.decoder = decoder
        self.tree = tree  # None: chain rounds
        self.drafter = drafter
        self.sampling = sampling
        self.generator = generator
        self.eos = eos
        self.pad = pad
        self.streamer = streamer
        self.stats = DecodeStats()
        # The chain-length policy (None: fixed N); a load-aware one keeps these rows' acceptance.
        self.draft_length = (
            draft_length.for_session(self)
            if isinstance(draft_length, LoadAwareDraftLength)
            else draft_length
        )
        # (start, verify start, verify end, end) of the last round, for a profile of its parts.
        self.last_round_times: tuple[float, float, float, float] | None = None
        self.target: CachedSequence | None = None
        self.pending = torch.zeros(0, dtype=torch.long, device=device)  # [B] not yet in caches
        self.count = torch.zeros(0, dtype=torch.long, device=device)  # [B] tokens emitted
        self.limit = torch.zeros(0, dtype=torch.long, device=device)  # [B] max_new_tokens
        self.active = torch.zeros(0, dtype=torch.bool, device=device)  # [B]
        # [B, C + 1] every emitted token (record=True) in C columns, grown on demand (a
        # max_new_tokens that EOS ends early costs nothing); the last column takes masked-out
        # writes. _most_emitted bounds every row's count from the host, without a sync.
        self.tokens = torch.full((0, 1), pad, dtype=torch.long, device=device) if record else None
        self._most_emitted = 0
        self._largest_limit = 0
        self._stopped = False

    @property
    def batch_size(self) -> int:
        return self.pending.shape[0]

    @torch.inference_mode()
    def add_rows(
        self,
        input_ids: torch.Tensor,  # [R, T] left-padded
        attention_mask: torch.Tensor | None = None,  # [R, T]
        max_new_tokens: int | Sequence[int] = 128,
    ) -> None:
        """Prefill ``R`` new rows as their own batch, merge them after the running rows (rows
        ``batch_size .. batch_size + R - 1``) and emit each one's first token."""
        decoder = self.decoder
        input_ids, attention_mask = decoder._check_inputs(input_ids, attention_mask, 1)
        if self.batch_size + input_ids.shape[0] > 1:
            problem = single_row_problem(decoder.target)
            if problem is not None:
                raise ValueError(problem)
        limits = _row_limits(max_new_tokens, input_ids.shape[0])
        _check_position_table(decoder.position_table, attention_mask, limits)
        start = _clock(decoder.device)
        drafter = self.drafter if self.batch_size == 0 else self.drafter.spawn()
        target = CachedSequence(
            decoder.target,
            input_ids.shape[0],
            decoder.device,
            decoder._target_head,
            decoder._target_decoder,
        )
        prefill = target.extend(
            input_ids,
            attention_mask.bool(),
            output_hidden_states=drafter.needs_hidden_states,
            logits_to_keep=1,
        )
        pending, _ = select_tokens(prefill.logits[:, -1], self.sampling, self.generator)
        drafter.prefill(
            input_ids, attention_mask, TargetPass(prefill.logits, prefill.hidden_states), pending
        )
        old = self.batch_size
        if old == 0:
            self.target = target
        else:
            self.target.merge(target)
            self.drafter.merge(drafter)
        device = self.pending.device
        self.pending = torch.cat([self.pending, pending])
        self.count = torch.cat([self.count, torch.zeros_like(pending)])
        self.limit = torch.cat([self.limit, limits.to(device)])
        self.active = torch.cat([self.active, torch.ones_like(pending, dtype=torch.bool)])
        self._largest_limit = max(self._largest_limit, int(limits.max()))
        if isinstance(self.draft_length, SessionDraftLength):
            self.draft_length.add_rows(input_ids.shape[0])
        if self.tokens is not None:
            self._grow_record(self.tokens.shape[1] - 1)
        new_rows = torch.arange(self.batch_size, device=device) >= old
        self.emit(self.pending[:, None], new_rows.long(), None, 0)
        self.stats.prefill_seconds += _clock(decoder.device) - start

    @torch.inference_mode()
    def step(self) -> None:
        """One speculative round for every row (a no-op when no row may emit more)."""
        room = self.room()
        if room == 0:
            return
        decoder = self.decoder
        # A round emits up to width + 1 tokens: no more drafts than the room left, and at
        # least one unless the adaptive policy chooses a plain step.
        limit = min(decoder.num_draft_tokens, room - 1)
        self.drafter.draft_room = max(1, room - 1)
        policy = self.draft_length
        width = max(1, limit) if policy is None else policy.choose(limit)
        round_fn = decoder._chain_round if self.tree is None else decoder._tree_round
        self.pending = round_fn(self, width)

    def retire(self, rows: Sequence[int]) -> None:
        """Drop ``rows`` (indices into the current batch); the others keep their order."""
        dropped = set(rows)
        keep = [row for row in range(self.batch_size) if row not in dropped]
        if isinstance(self.draft_length, SessionDraftLength):
            self.draft_length.select_rows(torch.tensor(keep, dtype=torch.long))
        if not keep:
            self.target = None
            self.pending, self.count = self.pending[:0], self.count[:0]
            self.limit, self.active = self.limit[:0], self.active[:0]
            if self.tokens is not None:
                self.tokens = self.tokens[:0]
            self._stopped = False
            return
        if len(keep) == self.batch_size:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.pending.device)
        self.target.select_rows(index)
        self.drafter.select_rows(index)
        self.pending, self.count = self.pending[index], self.count[index]
        self.limit, self.active = self.limit[index], self.active[index]
        if self.tokens is not None:
            self.tokens = self.tokens[index]

    def finished_rows(self) -> list[int]:
        """Rows that will emit nothing more (EOS or their ``max_new_tokens``), in one sync."""
        return torch.nonzero(~self.active).flatten().tolist()

    def room(self) -> int:
        """The most tokens any active row may still emit (0 when every row is done), in one
        host sync."""
        if self._stopped or self.batch_size == 0:
            return 0
        return max(0, int(torch.where(self.active, self.limit - self.count, 0).max()))

    def emit(
        self,
        new_tokens: torch.Tensor,  # [B, W]
        num_new: torch.Tensor,  # [B] valid prefix length of each row of new_tokens
        num_accepted: torch.Tensor | None,  # [B] drafts accepted this round; None: a prefill
        drafted: int,
    ) -> None:
        width = new_tokens.shape[1]
        columns = torch.arange(width, device=new_tokens.device)[None, :]
        num_new = torch.where(self.active, num_new, 0)
        num_new = torch.minimum(num_new, self.limit - self.count)
        if self.eos.numel():
            is_eos = torch.isin(new_tokens, self.eos) & (columns < num_new[:, None])
            hit = is_eos.any(1)
            num_new = torch.where(hit, is_eos.long().argmax(1) + 1, num_new)
        else:
            hit = torch.zeros_like(self.active)
        if self.tokens is not None:
            self._most_emitted = min(self._most_emitted + width, self._largest_limit)
            self._grow_record(self._most_emitted)
            spare = self.tokens.shape[1] - 1
            written = columns < num_new[:, None]
            target_column = torch.where(written, self.count[:, None] + columns, spare)
            self.tokens.scatter_(1, target_column, new_tokens)
        self.count += num_new
        if self.streamer is not None:
            rows = [row[:n] for row, n in zip(new_tokens.tolist(), num_new.tolist(), strict=True)]
            accepted = None if num_accepted is None else num_accepted.tolist()
            if self.streamer(RoundUpdate(rows, accepted, drafted)) is False:
                self._stopped = True
        self.active &= ~hit & (self.count < self.limit)

    def _grow_record(self, columns: int) -> None:
        """Give ``tokens`` a row per session row and at least ``columns`` columns before the
        spare one (doubling, so a long request copies its tokens O(log) times)."""
        tokens, have = self.tokens, self.tokens.shape[1] - 1
        if tokens.shape[0] == self.batch_size and columns <= have:
            return
        width = max(columns, 2 * have) if columns > have else have
        grown = torch.full(
            (self.batch_size, width + 1), self.pad, dtype=torch.long, device=tokens.device
        )
        grown[: tokens.shape[0], :have] = tokens[:, :have]  # the old spare column is dropped
        self.tokens = grown

    def finish_round(
        self,
        accepted_tokens: torch.Tensor,  # [B, D] drafts along the verified path
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
    ) -> None:
        """Record the round's acceptance and emit the accepted drafts plus the next token."""
        self.stats.record_round(num_accepted, accepted_tokens.shape[1], self.active)
        emitted = torch.cat([accepted_tokens, next_tokens[:, None]], dim=1)
        emitted.scatter_(1, num_accepted[:, None], next_tokens[:, None])
        self.emit(emitted, num_accepted + 1, num_accepted, accepted_tokens.shape[1])

    def add_times(self, start: float, verify_start: float, verify_end: float, end: float) -> None:
        self.last_round_times = (start, verify_start, verify_end, end)
        self.stats.verify_seconds += verify_end - verify_start
        self.stats.draft_seconds += (verify_start - start) + (end - verify_end)

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T + new]
        """The prompts followed by every emitted token (``record=True``), padded."""
        if self.tokens is None:
            raise RuntimeError("the session keeps no tokens: open it with record=True")
        longest = int(self.count.max())
        return torch.cat([input_ids, self.tokens[:, :longest]], dim=1)


def _check_position_table(
    table: int | None,  # the target's learned position table (``learned_position_limit``)
    attention_mask: torch.Tensor,  # [R, T] the rows' prompts, left-padded
    limits: torch.Tensor,  # [R] max_new_tokens of each row
) -> None:
    """``ValueError`` when a row's prompt and new tokens need positions past the target's
    learned table (the last new token is never fed back; padding takes no position)."""
    if table is None:
        return
    prompt_lengths = attention_mask.sum(-1).cpu()  # [R] real tokens of each row
    needed = prompt_lengths + limits - 1  # [R]
    row = int(needed.argmax())
    if int(needed[row]) > table:
        prompt, most_new = int(prompt_lengths[row]), int(limits[row])
        raise ValueError(
            f"the prompt ({prompt} tokens) and max_new_tokens={most_new} need {int(needed[row])} "
            f"positions, past the {table} of this target's learned position table: shorten "
            f"the prompt or pass max_new_tokens <= {max(table - prompt + 1, 0)}"
        )


# Limits are int64 tensors to which counts and widths are added: far from overflowing.
LARGEST_MAX_NEW_TOKENS = 2**62


def _row_limits(max_new_tokens: int | Sequence[int], rows: int) -> torch.Tensor:
    """``max_new_tokens`` per row ([R] int64): one int for every row, or one per row."""
    values = [max_new_tokens] * rows if _is_token_id(max_new_tokens) else max_new_tokens
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if len(values) != rows:
        raise ValueError(f"max_new_tokens gives {len(values)} limits for {rows} prompt rows")
    for value in values:
        if not _is_token_id(value):
            raise TypeError(f"max_new_tokens must be an int, got {value!r}")
        _check_limit(value)
    return torch.tensor([int(v) for v in values], dtype=torch.long)


def _check_limit(max_new_tokens: int) -> None:
    if not 1 <= max_new_tokens <= LARGEST_MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must lie in [1, 2**62], got {max_new_tokens}")


def _clock(device: torch.device) -> float:
    """Wall time, after the device finished its queued work (kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
