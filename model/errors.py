"""The one error type for everything that can be wrong with a model, its weights or tokenizer."""


class ModelLoadError(Exception):
    """A model directory, checkpoint, config or tokenizer cannot be used.

    The message is one line that names the file or field and, where it applies, the expected and
    the found value, so the CLI can print it as it is.
    """
