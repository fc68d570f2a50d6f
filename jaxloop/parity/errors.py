"""The port check's error for a batch a model rejects, naming the module that raised."""

from __future__ import annotations


class ModelError(RuntimeError):
    """A model rejected the batch: names the side, the innermost module running when it raised, the error."""

    def __init__(self, side: str, module: str, type_name: str, error: BaseException):
        self.side, self.module, self.type_name, self.error = side, module, type_name, error
        where = (
            f"module {module!r} ({type_name})"
            if module
            else ("the root module" + (f" ({type_name})" if type_name else ""))
            if type_name
            else "the loss, outside the model"
        )
        super().__init__(
            f"the {side} model rejects the batch: {where} raised {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        )
