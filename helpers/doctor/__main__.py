import sys

from helpers.doctor.cli import main

sys.exit(main())
