import sys

from splitrl.cli import main

sys.exit(main())
