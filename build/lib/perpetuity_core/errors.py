"""The project's errors, one base class for all of them.

    PerpetuityError
     ├── StoreError        the database could not be opened or written
     ├── ProtocolError     a body is not what its wire protocol says it should be
     └── ConfigError       an option or argument has a value we cannot use
"""


class PerpetuityError(Exception):
    pass


class StoreError(PerpetuityError):
    pass


class ProtocolError(PerpetuityError):
    pass


class ConfigError(PerpetuityError):
    pass
