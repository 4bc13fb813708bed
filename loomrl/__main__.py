import sys

from loomrl.cli import main

sys.exit(main())
