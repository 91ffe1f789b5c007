"""`python -m tfe_estimator.tools.bench`."""
import sys

from tfe_estimator.tools.bench import main

sys.exit(main())
