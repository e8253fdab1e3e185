import sys

from evaluation.cli import main

sys.exit(main())
