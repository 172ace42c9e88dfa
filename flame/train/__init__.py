"""The flame trainer: `python -m flame.train --config FILE [--section.key value ...]`."""
