"""`python -m flame.eval`: loss, perplexity and bits per byte of a trained model on a text file
(flame.inference.evaluation; `--help` lists the options)."""

import sys

from flame.inference.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
