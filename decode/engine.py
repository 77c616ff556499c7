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

from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType

import torch
from draftsmith.decode.defaults import NUM_DRAFT_TOKENS
from draftsmith.decode.draft_length import (
    AdaptiveDraftLength,
    LoadAwareDraftLength,
)
from draftsmith.decode.drafters.base import Drafter, TargetPass, TreeSpec, require_left_padded
from draftsmith.decode.forward.attention_layout import (
    learned_position_limit,
    tree_verification_problem,
)
from draftsmith.decode.forward.lean_decoder import LeanDecoder
from draftsmith.decode.forward.output_head import OutputHead
from draftsmith.decode.rejection import verify_chain
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs
from draftsmith.decode.session import (
    DecodeSession,
    Streamer,
    check_max_new_tokens,
    device_clock,
    is_token_id,
)
from draftsmith.decode.stats import DecodeStats


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
        start = device_clock(self.device)
        session.add_rows(input_ids, attention_mask, max_new_tokens)
        while session.room() > 0:
            session.step()
        stats = session.stats
        stats.total_seconds = device_clock(self.device) - start
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
        round_start = device_clock(self.device)
        proposal = drafter.propose(width, sampling, session.generator)
        drafts = proposal.tokens  # [B, n]
        verify_start = device_clock(self.device)
        verify = target.extend(
            torch.cat([session.pending[:, None], drafts], dim=1), output_hidden_states=needs_hidden
        )
        num_accepted, pending = verify_chain(
            drafts, proposal.probs, verify.logits, sampling, session.generator
        )
        target.rollback(drafts.shape[1] + 1, num_accepted + 1)
        verify_end = device_clock(self.device)
        drafter.commit(num_accepted, pending, TargetPass(verify.logits, verify.hidden_states))
        policy = session.draft_length
        accepted_by_active_rows = num_accepted[session.active] if policy is not None else None
        session.finish_round(drafts, num_accepted, pending)
        round_end = device_clock(self.device)
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
        round_start = device_clock(self.device)
        if sampled:
            tree = drafter.propose_sampled_tree(spec, width, sampling, generator)
        else:
            tree = drafter.propose_tree(spec, width)
        verify_start = device_clock(self.device)
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
        verify_end = device_clock(self.device)
        drafter.commit_tree(outcome, TargetPass(verify.logits, verify.hidden_states))
        session.finish_round(outcome.accepted_tokens, outcome.num_accepted, outcome.next_tokens)
        round_end = device_clock(self.device)
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
        check_max_new_tokens(max_new_tokens)
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
        if is_token_id(eos_token_id):
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
        if not is_token_id(token):
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


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, an index-less CUDA device meaning the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
