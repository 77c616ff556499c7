"""Block drafters: DFlash (one pass drafts a block of B - 1 tokens from the target's features)
and DSpark's Markov and confidence heads on it."""
