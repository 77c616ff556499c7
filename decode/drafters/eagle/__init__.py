"""The EAGLE family of heads: EAGLE-3 (chain and trees) and P-EAGLE (parallel drafting)."""
