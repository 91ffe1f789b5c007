"""`python -m tools.bench`."""
import sys

from tools.bench import main

sys.exit(main())
