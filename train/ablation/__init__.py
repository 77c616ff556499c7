"""Ablation grids: cells x seeds trained and measured, their results file and its tables."""
