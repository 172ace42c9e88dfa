"""`python -m flame.generate`: continue a prompt with a trained model (flame.inference.generation;
`--help` lists the options)."""

import sys

from flame.inference.generation import main

if __name__ == "__main__":
    sys.exit(main())
