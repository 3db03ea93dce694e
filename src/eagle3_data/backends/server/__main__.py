"""``python -m eagle3_data.backends.server supervise SPEC.json`` (:func:`.shared.main`)."""

import sys

from .shared import main

sys.exit(main())
