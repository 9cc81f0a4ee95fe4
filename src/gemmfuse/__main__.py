import sys

from gemmfuse.cli import main

sys.exit(main())
