"""Errors a user can cause. Each message says what to do; the CLI prints it as one line."""


class NeuronodeError(Exception):
    """Base of the errors a person can act on (exit status 1 unless a subclass says more)."""

    exit_code = 1


class ConfigError(NeuronodeError, ValueError):
    """A mistake in flags, environment or config file (exit status 2)."""

    exit_code = 2


class CheckpointError(NeuronodeError):
    """A checkpoint that cannot be used (corrupt, truncated, from another model)."""


class StatusError(NeuronodeError):
    """`neuronode status` could not get an answer."""
