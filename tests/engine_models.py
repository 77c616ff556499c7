"""Tiny targets that serving engines accept, and heads fitted to them in seconds.

vLLM's CPU attention supports head sizes from 32 up, so these targets use 2 heads of 32 (one
key/value head) instead of ``tiny_models``' head size 8. The heads are fitted for a few dozen
steps to the target's own greedy continuations, enough for drafts to be accepted often, so that
comparing acceptance counts between implementations checks something.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head, build_vocab_maps
from draftsmith.decode.drafters.medusa import MedusaHeads
from tiny_models import tiny_causal_lm

ENGINE_VOCAB = 256


def engine_llama(num_layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A float32 random Llama: vocab 256, width 64, 2 heads of 32, 1 key/value head."""
    return tiny_causal_lm(
        "llama",
        vocab_size=ENGINE_VOCAB,
        hidden_size=64,
        num_layers=num_layers,
        seed=seed,
        dtype=torch.float32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )


def save_target(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


@torch.no_grad()
def greedy_corpus(
    target: torch.nn.Module, rows: int = 24, prompt_len: int = 8, length: int = 48, seed: int = 0
) -> torch.Tensor:  # [rows, length]
    """Random prompts continued greedily by the target: what a drafter must predict."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (rows, prompt_len), generator=generator)
    for _ in range(length - prompt_len):
        logits = target(ids).logits[:, -1]
        ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
    return ids


def fit_eagle3(
    target: torch.nn.Module,
    corpus: torch.Tensor,  # [N, T]
    draft_vocab_size: int | None = None,
    steps: int = 60,
    unroll: int = 3,
    seed: int = 0,
    num_layers: int = 1,
) -> Eagle3Head:
    """An EAGLE-3 head trained by test-time unrolling on ``corpus`` (cross-entropy)."""
    torch.manual_seed(seed)
    config = Eagle3Config.for_target(
        target.config, draft_vocab_size=draft_vocab_size, num_hidden_layers=num_layers
    )
    head = Eagle3Head(config).float()
    vocab = target.config.vocab_size
    if config.draft_vocab_size != vocab:
        counts = torch.bincount(corpus.flatten(), minlength=vocab).double()
        head.set_vocab_maps(*build_vocab_maps(counts, config.draft_vocab_size))
    with torch.no_grad():
        out = target(corpus, output_hidden_states=True)
        aux = head.gather_aux(out.hidden_states)
        embeds = target.get_input_embeddings()(corpus)
        draft_id = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft id where kept
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    mask = torch.ones_like(corpus)
    next_embeds = torch.cat((embeds[:, 1:], torch.zeros_like(embeds[:, :1])), dim=1)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    length = corpus.shape[1]
    for _ in range(steps):
        loss = 0.0
        for k, logits in enumerate(head.unroll(aux, next_embeds, mask, unroll)):
            span = length - 2 - k
            labels = corpus[:, 2 + k :]
            kept = head.t2d[labels]
            targets = torch.where(kept, draft_id[labels], torch.full_like(labels, -100))
            loss = loss + F.cross_entropy(
                logits[:, :span].reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def fit_peagle(
    target: torch.nn.Module,
    corpus: torch.Tensor,  # [N, T]
    draft_vocab_size: int | None = None,
    steps: int = 60,
    depths: int = 3,
    num_layers: int = 1,
):
    """A P-EAGLE head trained on ``corpus`` through its own objective (forward KL, every
    anchor kept), its mask token the corpus's rarest."""
    from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleHead
    from draftsmith.train.losses import build_loss
    from draftsmith.train.objectives.peagle import PEagleObjective
    from objective_helpers import bind, train

    torch.manual_seed(0)
    config = PEagleConfig.for_target(
        target.config,
        draft_vocab_size=draft_vocab_size,
        num_depths=depths,
        num_hidden_layers=num_layers,
    )
    objective = PEagleObjective(
        PEagleHead(config).float(), target, build_loss("fkl"), unroll_steps=depths, cod_ratio=1.0
    )
    objective.prepare([{"input_ids": row.tolist()} for row in corpus])
    batch = {"input_ids": corpus, "attention_mask": torch.ones_like(corpus)}
    train(bind(objective), batch, steps=steps)
    return objective.head.eval()


def fit_medusa(
    target: torch.nn.Module, corpus: torch.Tensor, num_heads: int = 3, steps: int = 60
) -> MedusaHeads:
    """Medusa heads (one residual block each) trained on ``corpus``: head i predicts t+2+i."""
    heads = MedusaHeads.from_target(target, num_heads=num_heads, num_layers=1).float()
    with torch.no_grad():
        hidden = target(corpus, output_hidden_states=True).hidden_states[-1]
    optimizer = torch.optim.Adam(heads.parameters(), lr=3e-3)
    length = corpus.shape[1]
    for _ in range(steps):
        logits = heads(hidden)  # [N, T, K, V]
        loss = 0.0
        for i in range(num_heads):
            span = length - 2 - i
            loss = loss + F.cross_entropy(
                logits[:, :span, i].reshape(-1, logits.shape[-1]), corpus[:, 2 + i :].reshape(-1)
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return heads.eval()


def fit_dflash(
    target: torch.nn.Module,
    corpus: torch.Tensor,  # [N, T]
    block_size: int = 5,
    steps: int = 60,
    seed: int = 0,
    **options,
):
    """A DFlash head (``options``: DFlashConfig fields) trained on ``corpus`` (cross-entropy
    over every anchor's block), its output layer starting from the target's."""
    from draftsmith.decode.drafters.dflash.head import DFlashConfig, DFlashHead

    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target.config, block_size=block_size, **options)
    head = DFlashHead(config).float()
    vocab = target.config.vocab_size
    if config.draft_vocab_size != vocab:
        counts = torch.bincount(corpus.flatten(), minlength=vocab).double()
        head.set_vocab_maps(*build_vocab_maps(counts, config.draft_vocab_size))
    draft_id = torch.where(head.t2d, torch.cumsum(head.t2d.long(), 0) - 1, -100)
    with torch.no_grad():
        out = target(corpus, output_hidden_states=True)
        aux = head.gather_aux(out.hidden_states)
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    rows, length = corpus.shape
    anchors = torch.arange(1, length - 1).expand(rows, -1)  # every anchor with a label
    valid = torch.ones_like(anchors, dtype=torch.bool)
    later = anchors[:, :, None] + torch.arange(1, block_size)  # [N, M, B-1] guessed positions
    labels = corpus.gather(1, later.clamp(max=length - 1).reshape(rows, -1)).view(later.shape)
    labels = torch.where(later < length, draft_id[labels], torch.full_like(labels, -100))
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    embed = target.get_input_embeddings()
    for _ in range(steps):
        logits, _ = head.blocks(aux, corpus, embed, torch.ones_like(corpus), anchors, valid)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()
