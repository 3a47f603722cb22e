"""The project's errors, one base class for all of them.

    PerpetuityError
     ├── StoreError        the database could not be opened or written
     ├── ProtocolError     a body is not what its wire protocol says it should be
     ├── ConfigError       an option or argument has a value we cannot use
     ├── UpstreamError     the provider could not be reached, or its reply not read to its end
     └── BadArguments      a tool call's arguments do not fit its schema (also a ValueError)
"""


class PerpetuityError(Exception):
    pass


class StoreError(PerpetuityError):
    pass


class ProtocolError(PerpetuityError):
    pass


class ConfigError(PerpetuityError):
    pass


class UpstreamError(PerpetuityError):
    """The provider could not be reached, or its reply could not be read to its end."""


class BadArguments(PerpetuityError, ValueError):
    """The call's arguments do not fit its schema: the message tells the model what does."""
