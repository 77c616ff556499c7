"""The command lines over the packages (``python scripts/<name>.py`` or ``draftsmith-<name>``)."""
