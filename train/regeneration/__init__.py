"""Regenerated training data: the target's own responses, in process or through a serving endpoint."""
