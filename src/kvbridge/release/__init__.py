"""Publishing a mapper: its model card, manifest and example (``kvbridge card``, ``kvbridge push``)."""
