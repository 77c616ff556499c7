"""Decoding defaults, defined once: command lines, dataclasses and recipe fields import them.

``NUM_DRAFT_TOKENS`` is N, the chain length (or tree depth) drafted per round (docs/theory.md
§5 gives the expected gain as a function of N and the acceptance per position).
``TREE_TOP_K`` and ``TREE_TOTAL_TOKENS`` shape a dynamic draft tree (docs/theory.md §4):
children expanded per node and nodes kept per tree. They are the values the benchmark and the
post-training speed report measure with (docs/guides/benchmarks-and-results.md).
``DEMO_PROMPT_CHARS`` is the length, in characters, of the code before a ``def``/``class`` line
that makes one evaluation prompt (``draftsmith.decode.measure.prompts``), and of the training prompts cut in
that form (``train_prompts: definitions``, ``scripts/regenerate_data.py --prompts stdlib-defs``).
``LOOKUP_DRAFT_TOKENS`` is how many tokens a prompt-lookup round copies (the hybrid drafter's
rounds that copy without running its network, and the benchmark's prompt-lookup rows): a
copy costs no drafting, only verify rows, so it is not bound by N, which prices a network's
draft steps. Hugging Face's ``prompt_lookup_num_tokens`` defaults to the same 10.
``ADAPTIVE_DRAFT_TOKENS`` is the most drafts an adaptive round may take (``AdaptiveDraftLength``
picks each round's length in 0..this from measured acceptance and round times), so the
policy has room above the fixed N: on the demo target in bfloat16 (Intel Xeon with AMX, 2
cores; the main job's EAGLE-3 head, 12 prompts x 128 tokens) greedy rounds ran fastest at 6-7
drafts (fixed N = 6 1.09x N = 4 held-out, 1.03x ood), where the policy with room for 8 ran at
1.09x / 1.01x of N = 4. Sampled rounds ran fastest at about 4; there the policy ran at
0.92-1.05x of N = 4 over four 12-prompt samples and behind it in the benchmark (its rounds
settle shorter), so fixed rows and the main job keep N.
``MAX_SEED`` bounds a run seed (command lines and recipes): per-prompt seeds derived from it
(``draftsmith.decode.measure.side_by_side.prompt_seed``) still fit torch's 64-bit generator, and numpy takes it.
"""

from __future__ import annotations

NUM_DRAFT_TOKENS = 4
ADAPTIVE_DRAFT_TOKENS = 8
TREE_TOP_K = 4
TREE_TOTAL_TOKENS = 12
DEMO_PROMPT_CHARS = 400
LOOKUP_DRAFT_TOKENS = 10
MAX_SEED = 2**32 - 1
