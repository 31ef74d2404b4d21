import sys

from refusion.cli.main import console_main

sys.exit(console_main())
