"""The speculative decoder: propose -> verify -> accept -> roll back, round after round.

One round (docs/theory.md §1-3): the drafter guesses N tokens after each row's pending
token; the target scores ``[pending, d_1 .. d_N]`` in **one** forward pass over its KV cache;
verification keeps the accepted prefix and emits one recovered or bonus token; both caches drop
what was rejected (no re-prefill). Each round emits between 1 and N + 1 tokens per row, and
the output is distributed exactly as the target's (greedy: equal to its greedy output).

"The target's" means its forward on the cache (``CachedSequence``) with each call's positions.
Two rope types make a forward depend on how tokens are grouped into calls, in Hugging Face's
own forward too: dynamic NTK past ``max_position_embeddings`` and longrope in a call that
crosses ``original_max_position_embeddings`` (both switch frequencies by the call's largest
position). There a verification pass of N + 1 tokens and a one-token step may disagree; below
those thresholds (and for longrope wholly above it) every rope type is exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from decode.defaults import NUM_DRAFT_TOKENS
from decode.draft_length import AdaptiveDraftLength
from decode.drafters.base import Drafter, TargetPass, TreeSpec
from decode.kv_cache import CachedSequence
from decode.lean_decoder import LeanDecoder
from decode.output_head import OutputHead
from decode.rejection import verify_chain
from decode.sampling import SamplingConfig, logits_to_probs, select_tokens
from decode.stats import DecodeStats

# Called after every round with each row's newly emitted tokens; returning False stops early.
Streamer = Callable[[list[list[int]]], "bool | None"]


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
        (``AdaptiveDraftLength``; 0 is a plain target step); its estimates carry over from one
        ``generate`` call to the next."""
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise TypeError(f"num_draft_tokens must be an int, got {num_draft_tokens!r}")
        if num_draft_tokens < 1:
            raise ValueError(
                f"num_draft_tokens must be >= 1 (drafted tokens per round), got {num_draft_tokens}"
            )
        drafter.check_compatible(target)
        if adaptive and tree is not None:
            raise ValueError(
                "adaptive draft lengths apply to chains: drop the tree settings or adaptive=True"
            )
        if tree is not None and not drafter.supports_trees:
            raise ValueError(
                f"the {drafter.kind} drafter drafts chains only: drop the tree settings or use "
                "an eagle3 or medusa drafter"
            )
        self.tree = tree
        self.target = target.eval()
        self._target_head = OutputHead.for_model(self.target)
        self._target_decoder = (
            LeanDecoder.for_model(self.target)
            if lean_target and self._target_head is not None
            else None
        )
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.draft_length = AdaptiveDraftLength(num_draft_tokens) if adaptive else None

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
        (wrong values) or ``TypeError`` (wrong types) before any forward pass.
        """
        sampling = _sampling_config(sampling, temperature, top_k, top_p)
        if generator is not None:
            self._check_generator(generator)
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask, max_new_tokens)
        eos = self._eos_tensor(eos_token_id)
        pad = self._pad_id(pad_token_id, eos)
        run = _Run(input_ids.shape[0], max_new_tokens, self.num_draft_tokens, pad, eos, streamer)
        stats = run.stats
        needs_hidden = self.drafter.needs_hidden_states
        start = _clock(self.device)

        target = CachedSequence(
            self.target, input_ids.shape[0], self.device, self._target_head, self._target_decoder
        )
        prefill = target.extend(
            input_ids, attention_mask.bool(), output_hidden_states=needs_hidden, logits_to_keep=1
        )
        pending, _ = select_tokens(prefill.logits[:, -1], sampling, generator)
        self.drafter.prefill(
            input_ids, attention_mask, TargetPass(prefill.logits, prefill.hidden_states), pending
        )
        run.emit(pending[:, None], torch.ones_like(pending))
        stats.prefill_seconds = _clock(self.device) - start

        round_fn = self._chain_round if self.tree is None else self._tree_round
        while (room := run.room()) > 0:
            # A round emits up to width + 1 tokens: no more drafts than the room left, and at
            # least one unless the adaptive policy chooses a plain step.
            limit = min(self.num_draft_tokens, room - 1)
            width = max(1, limit) if self.draft_length is None else self.draft_length.choose(limit)
            pending = round_fn(target, pending, width, run, sampling, generator)

        stats.total_seconds = _clock(self.device) - start
        stats.tokens_emitted = int(run.count.sum())
        return GenerateOutput(sequences=run.sequences(input_ids), stats=stats.fold())

    def _chain_round(
        self,
        target: CachedSequence,
        pending: torch.Tensor,  # [B]
        width: int,  # draft tokens (chain length or tree depth) this round
        run: _Run,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> torch.Tensor:  # [B] the new pending tokens
        """Draft a chain, verify it in one target pass, roll both caches back, emit."""
        needs_hidden = self.drafter.needs_hidden_states
        round_start = _clock(self.device)
        proposal = self.drafter.propose(width, sampling, generator)
        drafts = proposal.tokens  # [B, n]
        verify_start = _clock(self.device)
        verify = target.extend(
            torch.cat([pending[:, None], drafts], dim=1), output_hidden_states=needs_hidden
        )
        num_accepted, pending = verify_chain(
            drafts, proposal.probs, verify.logits, sampling, generator
        )
        target.rollback(drafts.shape[1] + 1, num_accepted + 1)
        verify_end = _clock(self.device)
        self.drafter.commit(num_accepted, pending, TargetPass(verify.logits, verify.hidden_states))
        policy = self.draft_length
        accepted_by_active_rows = num_accepted[run.active] if policy is not None else None
        run.finish_round(drafts, num_accepted, pending)
        round_end = _clock(self.device)
        run.add_times(round_start, verify_start, verify_end, round_end)
        if policy is not None:  # read before finish_round retires rows that just ended
            policy.update(drafts.shape[1], accepted_by_active_rows, round_end - round_start)
        return pending

    def _tree_round(
        self,
        target: CachedSequence,
        pending: torch.Tensor,  # [B]
        width: int,  # draft tokens (chain length or tree depth) this round
        run: _Run,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> torch.Tensor:  # [B] the new pending tokens
        """Draft a tree, score all its nodes in one pass with a tree mask, keep one branch.

        At T > 0 a drafter with ``supports_sampled_trees`` draws its nodes from its own q
        (multi-draft speculative sampling, docs/theory.md §4); top-k trees serve T = 0 and
        drafters without sampled trees.
        """
        from decode.tree import verify_tree_greedy, verify_tree_stochastic

        round_start = _clock(self.device)
        if not sampling.greedy and self.drafter.supports_sampled_trees:
            tree = self.drafter.propose_sampled_tree(self.tree, width, sampling, generator)
        else:
            tree = self.drafter.propose_tree(self.tree, width)
        verify_start = _clock(self.device)
        verify = target.extend(
            tree.input_ids(pending),
            tree_mask=tree.attention_mask(),
            positions=tree.positions(target.lengths),
            output_hidden_states=self.drafter.needs_hidden_states,
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
        self.drafter.commit_tree(outcome, TargetPass(verify.logits, verify.hidden_states))
        run.finish_round(outcome.accepted_tokens, outcome.num_accepted, outcome.next_tokens)
        run.add_times(round_start, verify_start, verify_end, _clock(self.device))
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
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("prompts must be left-padded: the last column must be a real token")
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


class _Run:
    """Per-row output buffer and stopping state of one ``generate`` call."""

    def __init__(
        self,
        batch: int,
        max_new_tokens: int,
        num_draft_tokens: int,
        pad: int,
        eos: torch.Tensor,
        streamer: Streamer | None,
    ) -> None:
        device = eos.device
        self.max_new_tokens = max_new_tokens
        self.num_draft_tokens = num_draft_tokens
        self.eos = eos
        self.streamer = streamer
        self.stats = DecodeStats()
        # One spare column past the end takes the writes of masked-out slots.
        self.spare = max_new_tokens + num_draft_tokens + 1
        self.tokens = torch.full((batch, self.spare + 1), pad, dtype=torch.long, device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        self._stopped = False

    def room(self) -> int:
        """The most tokens any active row may still emit (0 when every row is done), in one
        host sync."""
        if self._stopped:
            return 0
        return max(0, int(torch.where(self.active, self.max_new_tokens - self.count, 0).max()))

    def emit(
        self,
        new_tokens: torch.Tensor,  # [B, W]
        num_new: torch.Tensor,  # [B] valid prefix length of each row of new_tokens
    ) -> None:
        width = new_tokens.shape[1]
        columns = torch.arange(width, device=new_tokens.device)[None, :]
        num_new = torch.where(self.active, num_new, 0)
        num_new = torch.minimum(num_new, self.max_new_tokens - self.count)
        if self.eos.numel():
            is_eos = torch.isin(new_tokens, self.eos) & (columns < num_new[:, None])
            hit = is_eos.any(1)
            num_new = torch.where(hit, is_eos.long().argmax(1) + 1, num_new)
        else:
            hit = torch.zeros_like(self.active)
        written = columns < num_new[:, None]
        target_column = torch.where(written, self.count[:, None] + columns, self.spare)
        self.tokens.scatter_(1, target_column, new_tokens)
        self.count += num_new
        if self.streamer is not None:
            rows = [row[:n] for row, n in zip(new_tokens.tolist(), num_new.tolist(), strict=True)]
            if self.streamer(rows) is False:
                self._stopped = True
        self.active &= ~hit & (self.count < self.max_new_tokens)

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
        self.emit(emitted, num_accepted + 1)

    def add_times(self, start: float, verify_start: float, verify_end: float, end: float) -> None:
        self.stats.verify_seconds += verify_end - verify_start
        self.stats.draft_seconds += (verify_start - start) + (end - verify_end)

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T + new]
        longest = int(self.count.max())
        return torch.cat([input_ids, self.tokens[:, :longest]], dim=1)


def _clock(device: torch.device) -> float:
    """Wall time, after the device finished its queued work (kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
