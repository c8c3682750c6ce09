"""The lab's one error type for what a user got wrong: the CLI says it in one line, exit status 2."""


class LabError(ValueError):
    """A user error the CLI reports in one line with exit status 2."""
