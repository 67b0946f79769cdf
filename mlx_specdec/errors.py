"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input from the user: a missing model, a corrupt file, an unknown method, ..."""


class ModelNotFound(UserError):
    pass


class UnsupportedModel(UserError):
    pass


class CorruptModel(UserError):
    pass


class ContextOverflow(UserError):
    pass
