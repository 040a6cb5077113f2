import sys

from torchqkit.cli import main

sys.exit(main())
