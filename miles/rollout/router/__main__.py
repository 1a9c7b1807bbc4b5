"""`python -m miles.rollout.router`: the built-in router in the foreground (as `miles router`)."""

import sys

from miles.rollout.router.app import main

sys.exit(main())
