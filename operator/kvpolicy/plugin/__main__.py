import sys

from kvpolicy.plugin.cli import main

sys.exit(main())
