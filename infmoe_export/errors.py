"""The one exception type a user sees (the CLI prints its message on one line and exits 1), and
the flag a Ctrl-C sets."""


class InfMoEError(Exception):
    """A problem with the user's input or environment, worded for the user."""


# Set by a Ctrl-C during a command (cli.py's SIGINT handler). A library may swallow the
# KeyboardInterrupt it raises (Polygraphy's bare `except:` around its lazy imports turns it into
# "unsupported type"; torch.export into an export failure; Python drops one raised while a
# finalizer runs): the error boundary then still reports an interruption, and long loops stop at
# their next step (raise_if_interrupted).
INTERRUPTED = {"on": False}


def raise_if_interrupted():
    """Raise the Ctrl-C again where a long loop can take it, if one came and was swallowed."""
    if INTERRUPTED["on"]:
        raise KeyboardInterrupt
