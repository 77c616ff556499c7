"""Measuring drafters: evaluation, side-by-side timing, benchmark prompts, ceilings, plots and the machine record."""
