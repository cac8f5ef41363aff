import sys

from joiner.app import main

sys.exit(main())
