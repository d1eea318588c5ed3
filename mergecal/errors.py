"""Errors with one-line messages that name the file, key or parameter at fault.

Every error the library raises for bad input derives from ``MergecalError``; the CLI prints
its message on one line and exits with status 2.
"""


class MergecalError(ValueError):
    """Base class for all input errors raised by mergecal."""


class CheckpointError(MergecalError):
    """A checkpoint file is missing, unreadable or malformed."""


class IncompatibleModelsError(MergecalError):
    """Models to be merged differ in key set, shape or dtype."""


class NonFiniteError(MergecalError):
    """A tensor contains NaN or Inf."""


class UnknownNameError(MergecalError):
    """An unknown method, key rule or option name."""


class ParameterError(MergecalError):
    """A hyperparameter has an invalid value."""


class OutputError(MergecalError):
    """An output cannot be written safely: it holds inputs or files mergecal did not write, another
    process is writing it, or the operating system refused."""
