"""Errors that mean "the user asked for something that cannot run": reported in one line, exit code 2."""


class NormlabError(Exception):
    pass


class ConfigError(NormlabError, ValueError):
    """A configuration that cannot describe a valid run."""


class DataError(NormlabError):
    """Prepared data that is missing, incomplete or does not fit the run."""


class TokenizerError(NormlabError):
    """No usable GPT-2 tokenizer."""


class NonFiniteError(NormlabError):
    """Training produced a non-finite loss or gradient."""
