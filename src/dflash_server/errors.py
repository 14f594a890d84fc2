"""Errors that reach a user as one clear line (CLI) or a 4xx (server), never a traceback."""


class UserError(Exception):
    """A problem with what the user asked for or supplied (flags, files, placement)."""

    exit_code = 2


class ModelLoadError(UserError):
    """A model directory or file is missing, corrupt, truncated or of an unknown architecture."""


class ShardError(RuntimeError):
    """A shard worker crashed, hung, or broke the protocol. The request fails (5xx); the
    worker is restarted and later requests can succeed."""


class Cancelled(Exception):
    """The caller gave up (client gone, server shutting down) during work that checks for
    it between pieces, such as prefill chunks. The engine's state is left for the next
    request to reset; the request ends with finish_reason "cancelled"."""


class CompressionError(RuntimeError):
    """PFlash: the prefill drafter failed on a prompt (not the prompt's fault). The request
    fails with a 500 that says so; nothing falls back to a silent full-length prefill."""
