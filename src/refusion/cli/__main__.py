import sys

from refusion.cli.main import main

sys.exit(main())
