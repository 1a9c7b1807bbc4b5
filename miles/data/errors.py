"""DataError: a row that cannot become a prompt. Its message names the file, the row and the field."""


class DataError(ValueError):
    """A row that cannot become a prompt: names the file, the row and the field."""
