"""`python -m tfe_estimator.bench`."""
import sys

from tfe_estimator.bench import main

sys.exit(main())
