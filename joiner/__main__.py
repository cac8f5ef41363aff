import sys

from joiner.faust_app import main

sys.exit(main())
