"""The one exception type a user sees: the CLI prints its message on one line and exits 1."""


class InfMoEError(Exception):
    """A problem with the user's input or environment, worded for the user."""
