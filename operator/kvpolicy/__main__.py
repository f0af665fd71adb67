import sys

from kvpolicy.cli import main

sys.exit(main())
