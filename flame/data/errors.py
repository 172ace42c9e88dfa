"""The one exception type of flame.data: the data or tokenizer of a job cannot be used."""


class DataError(ValueError):
    """A data source or tokenizer cannot be used: missing files, no network, wrong field, empty
    data, a record that cannot be read (named by file and line), a vocabulary that does not match
    the model, a loader state from another layout."""
